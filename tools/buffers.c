/* buffers.c — buffers.h on the library's memory functions. On cpu, mok_memory_alloc gives host
 * memory, so a buffer's host copy is its library memory (zero-copy); on cuda it gives device
 * memory of the rank's GPU and the host copy is a separate allocation. */
#include "buffers.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Cache-line alignment: more than MOK_ALIGN asks, and it keeps ranks' rows off shared lines. */
#define TOOLS_HOST_ALIGN 64

/* Poison is copied from a host buffer of 0xff bytes at most this large, chunk by chunk. */
#define TOOLS_POISON_CHUNK ((size_t)8 << 20)

void *tools_host_alloc(size_t bytes) {
    size_t rounded = bytes == 0 ? TOOLS_HOST_ALIGN : bytes;
    if (rounded > SIZE_MAX - TOOLS_HOST_ALIGN) return NULL;
    rounded = (rounded + TOOLS_HOST_ALIGN - 1) / TOOLS_HOST_ALIGN * TOOLS_HOST_ALIGN;
    return aligned_alloc(TOOLS_HOST_ALIGN, rounded);
}

static const char *name_of(const tools_buffer *buffer) { return buffer->what ? buffer->what : "a buffer"; }

static int library_error(const char *action, const tools_buffer *buffer, mok_status status) {
    fprintf(stderr, "mok run: %s %s (%zu bytes, %s rank %d): %s: %s\n", action, name_of(buffer),
            buffer->bytes, mok_backend_name(buffer->place.backend), buffer->place.local_rank,
            mok_status_string(status), mok_last_error());
    return -1;
}

static int host_out_of_memory(const tools_buffer *buffer) {
    fprintf(stderr, "mok run: out of host memory: %zu bytes for the host copy of %s\n", buffer->bytes,
            name_of(buffer));
    return -1;
}

/* Zeroes the buffer and records where it will live. */
static int start(tools_buffer *buffer, const tools_place *place, size_t bytes, const char *what) {
    memset(buffer, 0, sizeof *buffer);
    buffer->bytes = bytes;
    buffer->what = what;
    if (!place || !place->group) {
        fprintf(stderr, "mok run: no group to place %s in\n", what ? what : "a buffer");
        return -1;
    }
    buffer->place = *place;
    return 0;
}

static int allocate_device(tools_buffer *buffer) {
    void *device = NULL;
    mok_status status = mok_memory_alloc(buffer->place.group, buffer->place.local_rank, buffer->bytes, &device);
    if (status != MOK_OK) return library_error("cannot allocate", buffer, status);
    buffer->device = device;
    buffer->owns_device = 1;
    return 0;
}

int tools_buffer_create(tools_buffer *buffer, const tools_place *place, size_t bytes, const char *what) {
    if (start(buffer, place, bytes, what) != 0) return -1;
    if (allocate_device(buffer) != 0) return -1;
    if (place->backend == MOK_BACKEND_CPU) {
        buffer->host = buffer->device; /* host memory already: the host copy is an alias */
        return 0;
    }
    buffer->host = tools_host_alloc(bytes);
    if (!buffer->host) return host_out_of_memory(buffer);
    buffer->owns_host = 1;
    return 0;
}

int tools_buffer_create_device(tools_buffer *buffer, const tools_place *place, size_t bytes,
                               const char *what) {
    if (start(buffer, place, bytes, what) != 0) return -1;
    return allocate_device(buffer);
}

int tools_buffer_mirror(tools_buffer *buffer, const tools_place *place, void *host, size_t bytes,
                        const char *what) {
    if (start(buffer, place, bytes, what) != 0) return -1;
    buffer->host = host; /* the caller's; never freed here */
    if (place->backend == MOK_BACKEND_CPU) {
        buffer->device = host;
        return 0;
    }
    return allocate_device(buffer);
}

static int copy(const tools_buffer *buffer, void *dst, const void *src, size_t bytes, mok_copy_kind kind,
                const char *action) {
    mok_status status = mok_memory_copy(buffer->place.group, buffer->place.local_rank, dst, src, bytes, kind);
    return status == MOK_OK ? 0 : library_error(action, buffer, status);
}

int tools_buffer_upload(const tools_buffer *buffer) {
    if (buffer->bytes == 0 || buffer->host == buffer->device) return 0;
    if (!buffer->host || !buffer->device) {
        fprintf(stderr, "mok run: cannot upload %s: it has no host copy\n", name_of(buffer));
        return -1;
    }
    return copy(buffer, buffer->device, buffer->host, buffer->bytes, MOK_COPY_HOST_TO_RANK, "cannot upload");
}

int tools_buffer_download(tools_buffer *buffer) {
    if (buffer->bytes == 0 || buffer->host == buffer->device) return 0;
    if (!buffer->host || !buffer->device) {
        fprintf(stderr, "mok run: cannot download %s: it has no host copy\n", name_of(buffer));
        return -1;
    }
    return copy(buffer, buffer->host, buffer->device, buffer->bytes, MOK_COPY_RANK_TO_HOST, "cannot download");
}

int tools_buffer_read(const tools_buffer *buffer, size_t offset, void *dst, size_t bytes) {
    if (bytes == 0) return 0;
    if (!buffer->device || offset > buffer->bytes || bytes > buffer->bytes - offset) {
        fprintf(stderr, "mok run: cannot read bytes [%zu, +%zu) of %s: it has %zu\n", offset, bytes,
                name_of(buffer), buffer->device ? buffer->bytes : (size_t)0);
        return -1;
    }
    return copy(buffer, dst, (const char *)buffer->device + offset, bytes, MOK_COPY_RANK_TO_HOST, "cannot read");
}

int tools_buffer_poison(tools_buffer *buffer) {
    if (!buffer->device || buffer->bytes == 0) return 0;
    size_t chunk = buffer->bytes < TOOLS_POISON_CHUNK ? buffer->bytes : TOOLS_POISON_CHUNK;
    unsigned char *ones = tools_host_alloc(chunk);
    if (!ones) {
        fprintf(stderr, "mok run: out of host memory: %zu bytes to poison %s\n", chunk, name_of(buffer));
        return -1;
    }
    memset(ones, 0xff, chunk);
    int rc = 0;
    for (size_t done = 0; rc == 0 && done < buffer->bytes; done += chunk) {
        size_t n = buffer->bytes - done < chunk ? buffer->bytes - done : chunk;
        rc = copy(buffer, (char *)buffer->device + done, ones, n, MOK_COPY_HOST_TO_RANK, "cannot poison");
    }
    free(ones);
    return rc;
}

void tools_buffer_destroy(tools_buffer *buffer) {
    if (buffer->owns_host) free(buffer->host);
    if (buffer->owns_device && buffer->device) {
        mok_status status = mok_memory_free(buffer->place.group, buffer->place.local_rank, buffer->device);
        if (status != MOK_OK) library_error("cannot free", buffer, status);
    }
    memset(buffer, 0, sizeof *buffer);
}
