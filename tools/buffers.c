/* buffers.c — host-memory implementation of buffers.h. The cpu backend reads and writes host
 * memory directly, so the "device" pointer is the host pointer and uploads are no-ops. */
#include "buffers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Cache-line alignment: more than MOK_ALIGN asks, and it keeps ranks' rows off shared lines. */
#define TOOLS_HOST_ALIGN 64

void *tools_host_alloc(size_t bytes) {
    size_t rounded = bytes == 0 ? TOOLS_HOST_ALIGN : bytes;
    if (rounded > SIZE_MAX - TOOLS_HOST_ALIGN) return NULL;
    rounded = (rounded + TOOLS_HOST_ALIGN - 1) / TOOLS_HOST_ALIGN * TOOLS_HOST_ALIGN;
    return aligned_alloc(TOOLS_HOST_ALIGN, rounded);
}

static int unsupported(mok_backend backend, const char *what) {
    fprintf(stderr, "mok run: cannot place %s: %s memory is not available in this build of the command\n",
            what, mok_backend_name(backend));
    return -1;
}

static int out_of_memory(size_t bytes, const char *what) {
    fprintf(stderr, "mok run: out of host memory: %zu bytes for %s\n", bytes, what);
    return -1;
}

int tools_buffer_create(tools_buffer *buffer, mok_backend backend, size_t bytes, const char *what) {
    memset(buffer, 0, sizeof *buffer);
    if (backend != MOK_BACKEND_CPU) return unsupported(backend, what);
    buffer->host = tools_host_alloc(bytes);
    if (!buffer->host) return out_of_memory(bytes, what);
    buffer->device = buffer->host;
    buffer->bytes = bytes;
    buffer->owns_host = 1;
    return 0;
}

int tools_buffer_create_device(tools_buffer *buffer, mok_backend backend, size_t bytes,
                               const char *what) {
    if (tools_buffer_create(buffer, backend, bytes, what) != 0) return -1;
    buffer->host = NULL; /* on cpu the device memory is the only copy; it stays owned */
    buffer->owns_host = 0;
    buffer->owns_device = 1;
    return 0;
}

int tools_buffer_mirror(tools_buffer *buffer, mok_backend backend, void *host, size_t bytes,
                        const char *what) {
    memset(buffer, 0, sizeof *buffer);
    if (backend != MOK_BACKEND_CPU) return unsupported(backend, what);
    buffer->host = host;
    buffer->device = host;
    buffer->bytes = bytes;
    return 0;
}

int tools_buffer_upload(const tools_buffer *buffer, mok_backend backend) {
    (void)buffer; /* host and device are the same memory on cpu */
    return backend == MOK_BACKEND_CPU ? 0 : unsupported(backend, "an upload");
}

int tools_buffer_download(tools_buffer *buffer, mok_backend backend) {
    (void)buffer;
    return backend == MOK_BACKEND_CPU ? 0 : unsupported(backend, "a download");
}

int tools_buffer_poison(tools_buffer *buffer, mok_backend backend) {
    if (backend != MOK_BACKEND_CPU) return unsupported(backend, "poison");
    if (buffer->device) memset(buffer->device, 0xff, buffer->bytes);
    return 0;
}

void tools_buffer_destroy(tools_buffer *buffer, mok_backend backend) {
    (void)backend;
    if (buffer->owns_host) free(buffer->host);
    if (buffer->owns_device) free(buffer->device);
    memset(buffer, 0, sizeof *buffer);
}
