/* memory.c — memory.h: a run's peak host memory, counted from the tensors' shapes, and the host
 * memory available to this process. */
#include "memory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The reference works in blocks of rows (src/ref/ref.c); its per-block scratch is small beside
 * the layer, so this bound on it is enough. */
#define REFERENCE_BLOCK_ROWS 64

/* x, dy [T, H] bf16; topk_ids, router_w [T, k] 4 bytes; the rank's experts [3, E_local, I, H] bf16;
 * and the outputs: y, dx as bf16, d_router_w fp32, the gradients as bf16. */
static double rank_tensor_bytes(const tools_run_size *run) {
    const mok_shape *s = run->shape;
    const double T = (double)run->tokens, H = (double)s->hidden, k = (double)s->topk;
    const double experts = 3.0 * (double)(s->num_experts / run->nranks) * (double)s->intermediate * H;
    const double shared = 3.0 * (double)s->shared_intermediate * H;
    const double inputs = 2.0 * T * H * 2.0 + T * k * 8.0 + experts * 2.0;
    const double outputs = T * H * 2.0 + (run->backward ? T * H * 2.0 + T * k * 4.0 + (experts + shared) * 2.0 : 0.0);
    return inputs + (run->library_on_host ? outputs : 0.0);
}

/* The reference's peak: the command's buffers for it (y, dx bf16; the rest fp32) and, inside
 * mok_ref_backward (or mok_ref_forward without a backward; each frees its memory before it
 * returns), the fp64 copy of the layer, its fp64 outputs (and dy) and its scratch: the routed
 * rows' outputs [T, k, H] and the shared expert's [T, H] per rank. */
static double reference_bytes(const tools_run_size *run) {
    const mok_shape *s = run->shape;
    const double P = (double)run->nranks, T = (double)run->check_tokens, H = (double)s->hidden;
    const double k = (double)s->topk, wide = (double)(s->intermediate > s->shared_intermediate
                                                          ? s->intermediate : s->shared_intermediate);
    const double experts = 3.0 * (double)(s->num_experts / run->nranks) * (double)s->intermediate * H;
    const double shared = 3.0 * (double)s->shared_intermediate * H;
    const int b = run->backward;
    const double kept = P * (T * H * 2.0 + (b ? T * H * 2.0 + T * k * 4.0 + (experts + shared) * 4.0 : 0.0));
    const double layer = 8.0 * (P * (T * H + T * k + experts) + shared);
    const double outputs = 8.0 * P * (b ? 2.0 * T * H + T * k + experts + shared : T * H); /* dy with them */
    const double scratch = 8.0 * (P * (T * k * H + T * H) + 4.0 * REFERENCE_BLOCK_ROWS * wide + H);
    /* FP8: the quantized copy of x, dy and the weights, fp64 too */
    const double quantized = s->precision == MOK_PRECISION_FP8 ? 8.0 * (P * (2.0 * T * H + experts) + shared) : 0.0;
    return kept + layer + outputs + scratch + quantized;
}

tools_host_need tools_host_need_of(const tools_run_size *run) {
    tools_host_need need = {0.0, 0.0, 0.0, 0.0};
    const double P = (double)run->nranks;
    if (run->library_on_host)
        need.workspace = P * (run->workspace_bytes + run->schedule_bytes + run->context_bytes + run->fp8_weight_bytes);
    need.tensors = P * rank_tensor_bytes(run) + 3.0 * (double)run->shape->shared_intermediate *
                                                    (double)run->shape->hidden * 2.0;
    if (run->check) need.reference = reference_bytes(run);
    need.total = need.workspace + need.tensors + need.reference;
    return need;
}

/* The first number after `key` in a file of "key value" lines, times `unit`; -1 if absent. */
static double read_field(const char *path, const char *key, double unit) {
    FILE *f = fopen(path, "r");
    if (!f) return -1.0;
    char line[256];
    double value = -1.0;
    const size_t length = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, length) == 0) {
            double v;
            if (sscanf(line + length, " %lf", &v) == 1) value = v * unit;
            break;
        }
    fclose(f);
    return value;
}

/* A file holding one number (or "max": no limit, -1); -1 if absent. */
static double read_number(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return -1.0;
    double value = -1.0;
    if (fscanf(f, "%lf", &value) != 1) value = -1.0;
    fclose(f);
    return value;
}

/* What a cgroup's memory limit leaves (v2, else v1); -1 without a limit. */
static double cgroup_left(void) {
    double limit = read_number("/sys/fs/cgroup/memory.max");
    double used = read_number("/sys/fs/cgroup/memory.current");
    if (limit < 0.0) {
        limit = read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes");
        used = read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes");
    }
    if (limit < 0.0 || limit >= 1e18 || used < 0.0) return -1.0; /* "unlimited" is about 2^63 */
    return limit > used ? limit - used : 0.0;
}

/* MOK_HOST_MEMORY: a number of bytes, with an optional K, M, G or T (powers of 1024); -1 if unset
 * or not a size. */
static double host_memory_setting(void) {
    const char *text = getenv("MOK_HOST_MEMORY");
    if (!text || !*text) return -1.0;
    char *end = NULL;
    double value = strtod(text, &end);
    const char *units = "KMGT";
    const char *unit = *end ? strchr(units, *end) : NULL;
    if (unit && *unit) {
        for (const char *u = units; u <= unit; ++u) value *= 1024.0;
        ++end;
    }
    return end != text && *end == '\0' && value >= 0.0 ? value : -1.0;
}

double tools_host_available(void) {
    const double setting = host_memory_setting();
    if (setting >= 0.0) return setting;
    double available = read_field("/proc/meminfo", "MemAvailable:", 1024.0);
#ifdef _SC_AVPHYS_PAGES
    if (available < 0.0) {
        long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        if (pages > 0 && page > 0) available = (double)pages * (double)page;
    }
#endif
    double left = cgroup_left();
    if (left >= 0.0 && (available < 0.0 || left < available)) available = left;
    return available;
}
