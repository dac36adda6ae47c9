/* layout.c — the symmetric region's offsets (layout.h). The parts follow one another in the
 * order of mok_region_layout, each aligned; one that a backend does not have takes no bytes. The
 * order is free (peers find every part by its offset); the total is the sum of the aligned parts. */
#include "core/layout.h"

#include "core/plan.h"

/* Appends a part of `bytes` at *off (aligned) and returns its offset. */
static size_t part(size_t *off, size_t bytes, size_t align) {
    const size_t at = *off;
    *off = (at + bytes + align - 1) & ~(align - 1);
    return at;
}

void mok__region_layout(mok_region_layout *L, const mok_shape *s, const mok_config *c, size_t sched_bytes,
                        const mok_region_spec *spec) {
    const size_t T = (size_t)s->max_tokens, H = (size_t)s->hidden, k = (size_t)s->topk;
    const size_t ring = (size_t)c->ring_rows, a = spec->align;
    const size_t x_elem = spec->x_codes ? 1 : 2, x_scales = spec->x_codes ? H / MOK_FP8_BLOCK * 4 : 0;
    size_t off = 0;
    L->flags = part(&off, spec->flags_bytes, a);
    L->calls = part(&off, spec->calls_bytes, a);
    L->blob = part(&off, spec->blob_bytes, a);
    L->tokens = part(&off, sizeof(int64_t), a);
    L->x = part(&off, T * H * x_elem, a);
    L->x_scale = part(&off, T * x_scales, a);
    L->router_w = part(&off, T * k * 4, a);
    L->ids = part(&off, T * k * 4, a);
    L->comb = part(&off, T * k * H * 2, a);
    L->dy = part(&off, T * H * 2, a);
    L->dxbuf = part(&off, T * k * H * 2, a);
    L->drw = part(&off, T * k * 4, a);
    L->turned = mok__config_turned(c);
    const int r = spec->rings != 0;
    L->sched = part(&off, r ? sched_bytes : 0, a);
    L->counters = part(&off, r ? (size_t)spec->counters * sizeof(uint64_t) : 0, a);
    L->ring_x = part(&off, r ? ring * H * x_elem : 0, a);
    L->ring_x_scale = part(&off, r ? ring * x_scales : 0, a);
    L->ring_y = part(&off, r ? ring * H * 2 : 0, a);
    L->ring_dy = part(&off, r ? ring * H * 2 : 0, a);
    L->ring_dyw = part(&off, r && spec->ring_dyw ? ring * H * 2 : 0, a);
    L->ring_w = part(&off, r ? ring * 4 : 0, a);
    L->ring_rdot = part(&off, r ? ring * (size_t)spec->rdot_cols * 4 : 0, a);
    if (!r) L->sched = L->counters = L->ring_x = L->ring_x_scale = L->ring_y = L->ring_dy = L->ring_dyw = L->ring_w =
                L->ring_rdot = 0;
    L->failed = part(&off, spec->failed ? sizeof(int32_t) : 0, a);
    L->bytes = off;
}
