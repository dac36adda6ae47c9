/* mp_rank.c — one rank of a multi-process EP group as a program of its own (build/mok_mp_rank),
 * for tools that must see each GPU's kernels in a process of their own: compute-sanitizer runs a
 * process's kernels one at a time, so one process driving two GPUs waits out its first cross-GPU
 * barrier (scripts/gpu-check.sh --sanitize runs EP2 as two of these).
 *
 *   build/mok_mp_rank --rank R --ranks P --id-file PATH [--timeout-ms N] [--seed N] [--backend cuda|cpu]
 *                     [--transfers default|turned]
 *
 * Rank 0 makes the group's unique id and writes it, with P and the seed, to PATH atomically (a
 * temporary file renamed over PATH); the other ranks wait for PATH, and refuse an id made for
 * another P or seed. Each process joins as rank R on GPU R and runs the case of sanitize_case in
 * test_cuda.c on its own rank (several macrobatches, replayed rows, -1 slots, router weights <= 0,
 * the shared expert; tokens 150 and 97): schedule, forward, backward. Every process builds the
 * whole layer from the seed (tests/layer.c gives the same bits in every process), so each checks
 * its own y, dx, d_router_w and weight gradients against the reference of the whole layer.
 *
 * PATH must not exist when rank 0 starts (a stale id would send the other ranks to a dead group):
 * give every run a fresh one. Rank 0 removes it once every rank has joined the group (and so has
 * read it). --timeout-ms bounds the wait for the id file and for every peer
 * (config.peer_timeout_ms); default 60000. --backend cpu runs the same steps on the cpu backend,
 * one rank only (its ranks are threads of one process): the driver's own check on any machine
 * (tests/cli.sh). --transfers turned runs every transfer in the other direction (config
 * fwd_dispatch = bwd_combine = MOK_PUSH, fwd_combine = bwd_dispatch = MOK_PULL); every rank of a
 * group must be given the same.
 *
 * Prints PASS / FAIL per step like the test runner and closes with `N passed, N failed`. Exit
 * status: 0 every check passed, 1 a check failed, 2 bad arguments, 3 this build or machine cannot
 * run it (no cuda backend, or no GPU R). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "layer.h"

enum { EXIT_PASS = 0, EXIT_FAILED = 1, EXIT_USAGE = 2, EXIT_CANNOT_RUN = 3 };

static const char usage[] =
    "usage: mok_mp_rank --rank R --ranks P --id-file PATH [--timeout-ms N] [--seed N] [--backend cuda|cpu]\n"
    "                   [--transfers default|turned]\n"
    "  one rank of a P-process group on GPU R; rank 0 writes the unique id to PATH (which must not\n"
    "  exist yet), the others wait for it. Runs sanitize_case's layer (tests/test_cuda.c) forward and\n"
    "  backward and checks this rank's outputs against the reference of the whole layer.\n"
    "  --backend cpu: the same on the cpu backend, for --ranks 1 only.\n";

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A whole decimal number in [lo, hi], or -1 with a message. */
static int parse_int(const char *flag, const char *text, long long lo, long long hi, long long *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi) {
        fprintf(stderr, "mok_mp_rank: %s expects an integer in [%lld, %lld], not '%s'\n", flag, lo, hi, text);
        return -1;
    }
    *out = v;
    return 0;
}

/* ---- the id file ----------------------------------------------------------------------------- */

/* What rank 0 writes: the id, and what every rank must agree on to build the same layer. */
typedef struct id_file {
    char magic[8]; /* "mokid1" */
    int64_t ranks;
    uint64_t seed;
    mok_unique_id id;
} id_file;

static const char id_magic[8] = "mokid1";

/* Rank 0: writes f to a temporary file beside path, then renames it over path, so a reader sees
 * either no file or the whole of it. */
static int id_write(const char *path, const id_file *f) {
    if (access(path, F_OK) == 0) {
        fprintf(stderr, "mok_mp_rank: --id-file %s exists already (an earlier run's?); give every run a fresh path\n",
                path);
        return -1;
    }
    char tmp[4096];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= sizeof tmp) {
        fprintf(stderr, "mok_mp_rank: --id-file path too long\n");
        return -1;
    }
    FILE *out = fopen(tmp, "wb");
    if (!out) {
        fprintf(stderr, "mok_mp_rank: cannot create %s: %s\n", tmp, strerror(errno));
        return -1;
    }
    int bad = fwrite(f, sizeof *f, 1, out) != 1;
    bad |= fflush(out) != 0;
    bad |= fsync(fileno(out)) != 0;
    bad |= fclose(out) != 0;
    if (bad || rename(tmp, path) != 0) {
        fprintf(stderr, "mok_mp_rank: writing the id to %s failed: %s\n", path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* Other ranks: wait (bounded) for path, then read it whole. */
static int id_read(const char *path, double timeout_ms, id_file *f) {
    const double deadline = now_ms() + timeout_ms;
    for (;;) {
        FILE *in = fopen(path, "rb");
        if (in) {
            struct stat st;
            long long size = fstat(fileno(in), &st) == 0 ? (long long)st.st_size : -1;
            int ok = size == (long long)sizeof *f && fread(f, sizeof *f, 1, in) == 1;
            fclose(in);
            if (ok && !memcmp(f->magic, id_magic, sizeof id_magic)) return 0;
            fprintf(stderr, "mok_mp_rank: %s is not an id file of mok_mp_rank (%lld bytes)\n", path, size);
            return -1;
        }
        if (errno != ENOENT) {
            fprintf(stderr, "mok_mp_rank: cannot open %s: %s\n", path, strerror(errno));
            return -1;
        }
        if (now_ms() > deadline) {
            fprintf(stderr, "mok_mp_rank: no id file at %s after %.0f ms (--timeout-ms): did rank 0 start?\n", path,
                    timeout_ms);
            return -1;
        }
        sleep_ms(10);
    }
}

/* ---- the run --------------------------------------------------------------------------------- */

static int passed, failed;

/* One step's PASS / FAIL line, in the runner's format. */
static int report(int ok, const char *name, double t0, const char *why) {
    if (ok) printf("PASS %-48s %6.2fs\n", name, (now_ms() - t0) / 1e3);
    else printf("FAIL %-48s (%s)\n", name, why);
    fflush(stdout);
    if (ok) ++passed;
    else ++failed;
    return ok;
}

/* A pass's step: waits for the rank's stream when the calls succeeded, then reports the step. */
static int report_pass(mok_workspace *ws, mok_status st, int nranks, int rank, const char *step, double t0) {
    char name[96], why[1200];
    if (st == MOK_OK) st = mok_synchronize(ws);
    snprintf(why, sizeof why, "%s: %s", mok_status_string(st), mok_last_error());
    snprintf(name, sizeof name, "ep%d rank %d: %s", nranks, rank, step);
    return report(st == MOK_OK, name, t0, why);
}

/* This rank's device buffers. */
enum { B_X, B_IDS, B_RW, B_Y, B_SCHEDULE, B_CONTEXT, B_DY, B_DX, B_DRW, B_W, B_S = B_W + 3, B_DW = B_S + 3,
       B_DS = B_DW + 3, B_NUM = B_DS + 3 };

typedef struct rank_run {
    mok_group *group;
    mok_workspace *ws;
    mok_sizes sizes;
    void *buf[B_NUM];
    size_t bytes[B_NUM];
} rank_run;

/* Allocates buffer b (r->bytes[b] bytes; 0: none) and copies the first host_bytes of it from host. */
static mok_status place(rank_run *r, int b, const void *host, size_t host_bytes) {
    if (!r->bytes[b]) return MOK_OK;
    mok_status st = mok_memory_alloc(r->group, 0, r->bytes[b], &r->buf[b]);
    if (st == MOK_OK && host && host_bytes)
        st = mok_memory_copy(r->group, 0, r->buf[b], host, host_bytes, MOK_COPY_HOST_TO_RANK);
    return st;
}

/* Allocates buffer b and fills all of it with a poison pattern: fp32 bits (f32) or bf16 bits. */
static mok_status place_poisoned(rank_run *r, int b, uint32_t pattern, int f32) {
    if (!r->bytes[b]) return MOK_OK;
    void *fill = malloc(r->bytes[b]);
    if (!fill) return MOK_ERR_OUT_OF_MEMORY;
    if (f32)
        for (size_t i = 0; i < r->bytes[b] / 4; ++i) ((uint32_t *)fill)[i] = pattern;
    else
        for (size_t i = 0; i < r->bytes[b] / 2; ++i) ((uint16_t *)fill)[i] = (uint16_t)pattern;
    mok_status st = place(r, b, fill, r->bytes[b]);
    free(fill);
    return st;
}

static void download(rank_run *r, int b, void **out, size_t bytes) {
    *out = malloc(bytes + 16);
    if (*out && bytes) mok_memory_copy(r->group, 0, *out, r->buf[b], bytes, MOK_COPY_RANK_TO_HOST);
}

static int run_rank(mok_backend backend, int rank, int nranks, const char *id_path, double timeout_ms,
                    uint64_t seed, int turned) {
    /* The layer of sanitize_case (tests/test_cuda.c), every rank's, built alike in every process.
       Past two ranks the tokens keep alternating 150, 97 and E = 4 is rounded up to a multiple of P. */
    const int64_t experts = nranks * ((4 + nranks - 1) / nranks);
    mok_shape shape = {128, 128, experts, 2, 128, 1, MOK_PRECISION_BF16};
    int64_t tokens[MOK_MAX_RANKS];
    for (int p = 0; p < nranks; ++p) tokens[p] = p % 2 ? 97 : 150;
    layer L;
    if (layer_make(&L, &shape, nranks, tokens, seed, LAYER_ROUTE_HOLES | LAYER_SIGNED_WEIGHTS) != 0) {
        fprintf(stderr, "mok_mp_rank: layer_make failed\n");
        return EXIT_FAILED;
    }
    mok_config cfg = mok_config_default();
    cfg.minibatch_rows = 128;
    cfg.ring_rows = 256;
    cfg.context_rows = 128;
    cfg.fwd_comm_sms = cfg.bwd_comm_sms = 2;
    if (turned) {
        cfg.fwd_dispatch = cfg.bwd_combine = MOK_PUSH;
        cfg.fwd_combine = cfg.bwd_dispatch = MOK_PULL;
    }
    cfg.peer_timeout_ms = timeout_ms;
    cfg.swiglu_limit = L.swiglu_limit;
    char name[96], why[1200];
    const char *tag_fmt = "ep%d rank %d: %s";

    /* The id: made by rank 0, passed through the file. */
    id_file f;
    memset(&f, 0, sizeof f);
    double t0 = now_ms();
    int ok = 1;
    if (rank == 0) {
        memcpy(f.magic, id_magic, sizeof id_magic);
        f.ranks = nranks;
        f.seed = seed;
        mok_status st = mok_unique_id_create(backend, &f.id);
        if (st != MOK_OK) fprintf(stderr, "mok_mp_rank: mok_unique_id_create: %s\n", mok_last_error());
        ok = st == MOK_OK && id_write(id_path, &f) == 0;
    } else {
        ok = id_read(id_path, timeout_ms, &f) == 0;
        if (ok && (f.ranks != nranks || f.seed != seed)) {
            fprintf(stderr, "mok_mp_rank: rank 0 was started with --ranks %lld --seed %llu, this rank with --ranks %d "
                            "--seed %llu\n", (long long)f.ranks, (unsigned long long)f.seed, nranks,
                    (unsigned long long)seed);
            ok = 0;
        }
    }
    snprintf(name, sizeof name, tag_fmt, nranks, rank, "unique id through the file");
    if (!report(ok, name, t0, "see the message above")) {
        layer_free(&L);
        return EXIT_FAILED;
    }

    /* Group, workspace, buffers. */
    rank_run r;
    memset(&r, 0, sizeof r);
    t0 = now_ms();
    const char *call = "mok_group_create";
    mok_status st = mok_group_create(&r.group, backend, nranks, rank, &f.id, rank, &cfg);
    /* Every rank has joined, so every rank has read the id: the file can go (PATH is free again). */
    if (st == MOK_OK && rank == 0) unlink(id_path);
    if (st == MOK_OK) {
        call = "mok_workspace_create";
        st = mok_workspace_create(&r.ws, r.group, &L.shape, &cfg);
    }
    if (st == MOK_OK) {
        call = "mok_workspace_sizes";
        st = mok_workspace_sizes(r.ws, &r.sizes);
    }
    const size_t H = (size_t)L.shape.hidden, I = (size_t)L.shape.intermediate, k = (size_t)L.shape.topk;
    const size_t Is = (size_t)L.shape.shared_intermediate, El = (size_t)(L.shape.num_experts / nranks);
    const size_t T = (size_t)L.num_tokens[rank], T_max = (size_t)L.shape.max_tokens;
    r.bytes[B_X] = r.bytes[B_DY] = r.bytes[B_DX] = T * H * 2 + 16;
    r.bytes[B_IDS] = r.bytes[B_RW] = r.bytes[B_DRW] = T * k * 4 + 16;
    r.bytes[B_Y] = T_max * H * 2;
    r.bytes[B_SCHEDULE] = r.sizes.schedule_bytes;
    r.bytes[B_CONTEXT] = r.sizes.context_bytes;
    for (int m = 0; m < 3; ++m) {
        r.bytes[B_W + m] = r.bytes[B_DW + m] = El * I * H * 2;
        r.bytes[B_S + m] = r.bytes[B_DS + m] = Is * H * 2;
    }
    if (st == MOK_OK) {
        call = "placing the buffers";
        st = place(&r, B_X, L.x[rank], T * H * 2);
        if (st == MOK_OK) st = place(&r, B_IDS, L.topk_ids[rank], T * k * 4);
        if (st == MOK_OK) st = place(&r, B_RW, L.router_w[rank], T * k * 4);
        if (st == MOK_OK) st = place(&r, B_DY, L.dy[rank], T * H * 2);
        for (int m = 0; m < 3 && st == MOK_OK; ++m) {
            st = place(&r, B_W + m, L.w[m][rank], r.bytes[B_W + m]);
            if (st == MOK_OK) st = place(&r, B_S + m, L.s[m], r.bytes[B_S + m]);
        }
        /* Outputs poisoned, so that an element the library forgot shows up as unwritten. */
        if (st == MOK_OK) st = place_poisoned(&r, B_Y, LAYER_POISON_BF16, 0);
        if (st == MOK_OK) st = place_poisoned(&r, B_DX, LAYER_POISON_BF16, 0);
        if (st == MOK_OK) st = place_poisoned(&r, B_DRW, LAYER_POISON_F32_BITS, 1);
        for (int m = 0; m < 3 && st == MOK_OK; ++m) {
            st = place_poisoned(&r, B_DW + m, LAYER_POISON_BF16, 0);
            if (st == MOK_OK) st = place_poisoned(&r, B_DS + m, LAYER_POISON_BF16, 0);
        }
        if (st == MOK_OK) st = place_poisoned(&r, B_SCHEDULE, 0xa5a5, 0);
        if (st == MOK_OK) st = place_poisoned(&r, B_CONTEXT, LAYER_POISON_BF16, 0);
    }
    snprintf(why, sizeof why, "%s: %s", call, mok_last_error());
    snprintf(name, sizeof name, tag_fmt, nranks, rank, "group, workspace, buffers");
    ok = report(st == MOK_OK, name, t0, why);

    /* Forward: schedule + forward (on cuda: this rank's GPU, the default stream). */
    void **b = r.buf;
    if (ok) {
        t0 = now_ms();
        mok_schedule_args sa = {(int64_t)T, b[B_IDS], b[B_SCHEDULE], NULL};
        mok_forward_args fa = {(int64_t)T, b[B_SCHEDULE], b[B_X], b[B_RW], b[B_W], b[B_W + 1], b[B_W + 2],
                               b[B_S], b[B_S + 1], b[B_S + 2], b[B_Y], b[B_CONTEXT], NULL, NULL};
        st = mok_schedule_build(r.ws, &sa);
        if (st == MOK_OK) st = mok_forward(r.ws, &fa);
        ok = report_pass(r.ws, st, nranks, rank, "forward", t0);
    }
    /* Backward: bf16 gradients, overwritten (accumulate = 0). */
    if (ok) {
        t0 = now_ms();
        mok_backward_args ba = {(int64_t)T, b[B_SCHEDULE], b[B_CONTEXT], b[B_DY], b[B_X], b[B_RW], b[B_W], b[B_W + 1],
                                b[B_W + 2], b[B_S], b[B_S + 1], b[B_S + 2], b[B_DX], b[B_DRW], 0, b[B_DW],
                                b[B_DW + 1], b[B_DW + 2], b[B_DS], b[B_DS + 1], b[B_DS + 2], NULL, NULL};
        st = mok_backward(r.ws, &ba);
        ok = report_pass(r.ws, st, nranks, rank, "backward", t0);
    }
    /* This rank's outputs against the reference of the whole layer. */
    if (ok) {
        t0 = now_ms();
        layer_result got = {0}, ref = {0};
        got.nranks = nranks;
        got.grads_f32 = 0;
        download(&r, B_Y, (void **)&got.y[rank], T * H * 2);
        download(&r, B_DX, (void **)&got.dx[rank], T * H * 2);
        download(&r, B_DRW, (void **)&got.d_router_w[rank], T * k * 4);
        for (int m = 0; m < 3; ++m) {
            download(&r, B_DW + m, &got.dw[m][rank], El * I * H * 2);
            if (Is) download(&r, B_DS + m, &got.ds[m][rank], Is * H * 2);
        }
        snprintf(name, sizeof name, tag_fmt, nranks, rank, "outputs and gradients vs reference");
        st = layer_run_reference(&L, &ref);
        double err = st == MOK_OK ? layer_compare_rank(&L, &got, &ref, rank, name) : 1e300;
        if (st == MOK_OK) snprintf(why, sizeof why, "worst error %.3f of the tolerance; the lines above say where", err);
        else snprintf(why, sizeof why, "the reference failed: %s", ref.message);
        ok = report(err <= 1.0, name, t0, why);
        if (ok) printf("     worst error %.3f of the tolerance (layer.c's table)\n", err);
        layer_result_free(&got);
        layer_result_free(&ref);
    }

    /* Collective teardown: every rank gets here, whatever its checks said. */
    for (int i = 0; i < B_NUM && r.group; ++i)
        if (r.buf[i]) mok_memory_free(r.group, 0, r.buf[i]);
    mok_workspace_destroy(r.ws);
    mok_group_destroy(r.group);
    layer_free(&L);
    return failed ? EXIT_FAILED : EXIT_PASS;
}

int main(int argc, char **argv) {
    long long rank = -1, nranks = -1, timeout_ms = 60000, seed = 1;
    const char *id_path = NULL;
    mok_backend backend = MOK_BACKEND_CUDA;
    int turned = 0;
    for (int i = 1; i < argc; ++i) {
        const char *flag = argv[i];
        if (!strcmp(flag, "--help") || !strcmp(flag, "-h")) {
            fputs(usage, stdout);
            return EXIT_PASS;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "mok_mp_rank: %s needs a value\n%s", flag, usage);
            return EXIT_USAGE;
        }
        const char *value = argv[++i];
        int bad = 0;
        if (!strcmp(flag, "--rank")) bad = parse_int(flag, value, 0, MOK_MAX_RANKS - 1, &rank);
        else if (!strcmp(flag, "--ranks")) bad = parse_int(flag, value, 1, MOK_MAX_RANKS, &nranks);
        else if (!strcmp(flag, "--timeout-ms")) bad = parse_int(flag, value, 1, 24LL * 3600 * 1000, &timeout_ms);
        else if (!strcmp(flag, "--seed")) bad = parse_int(flag, value, 0, (1LL << 62), &seed);
        else if (!strcmp(flag, "--id-file")) id_path = value;
        else if (!strcmp(flag, "--backend") && (!strcmp(value, "cuda") || !strcmp(value, "cpu")))
            backend = strcmp(value, "cpu") ? MOK_BACKEND_CUDA : MOK_BACKEND_CPU;
        else if (!strcmp(flag, "--transfers") && (!strcmp(value, "default") || !strcmp(value, "turned")))
            turned = !strcmp(value, "turned");
        else if (!strcmp(flag, "--transfers")) {
            fprintf(stderr, "mok_mp_rank: --transfers expects default or turned, not '%s'\n", value);
            return EXIT_USAGE;
        }
        else if (!strcmp(flag, "--backend")) {
            fprintf(stderr, "mok_mp_rank: --backend expects cuda or cpu, not '%s'\n", value);
            return EXIT_USAGE;
        }
        else {
            fprintf(stderr, "mok_mp_rank: unknown option '%s'\n%s", flag, usage);
            return EXIT_USAGE;
        }
        if (bad) return EXIT_USAGE;
    }
    if (rank < 0 || nranks < 0 || !id_path || !*id_path) {
        fprintf(stderr, "mok_mp_rank: --rank, --ranks and --id-file are required\n%s", usage);
        return EXIT_USAGE;
    }
    if (rank >= nranks) {
        fprintf(stderr, "mok_mp_rank: --rank %lld is not below --ranks %lld\n", rank, nranks);
        return EXIT_USAGE;
    }
    if (backend == MOK_BACKEND_CPU && nranks != 1) {
        fprintf(stderr, "mok_mp_rank: --backend cpu runs --ranks 1 only (cpu ranks are threads of one process)\n");
        return EXIT_USAGE;
    }
    const int gpus = mok_backend_available(MOK_BACKEND_CUDA);
    if (backend == MOK_BACKEND_CUDA && gpus <= rank) {
#ifdef MOK_HAVE_CUDA
        fprintf(stderr, "mok_mp_rank: rank %lld runs on GPU %lld, and this machine has %d usable GPU%s\n", rank, rank,
                gpus, gpus == 1 ? "" : "s");
#else
        fprintf(stderr, "mok_mp_rank: needs the cuda backend, and this build has none (build with make CUDA=1)\n");
#endif
        return EXIT_CANNOT_RUN;
    }
    printf("seed %lld (--seed %lld reproduces); rank %lld of %lld on %s %lld; id file %s; %s transfers\n", seed, seed,
           rank, nranks, backend == MOK_BACKEND_CUDA ? "GPU" : "cpu, rank", rank, id_path,
           turned ? "turned" : "default");
    fflush(stdout);
    int status = run_rank(backend, (int)rank, (int)nranks, id_path, (double)timeout_ms, (uint64_t)seed, turned);
    printf("%d passed, %d failed\n", passed, failed);
    return status;
}
