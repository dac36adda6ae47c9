/* test_layout.c — the host core that both backends share: the symmetric region's layout
 * (core/layout.h) for the cpu and cuda backends' specs, and a config as a pass's plan
 * (core/plan.h). */
#include <stdint.h>
#include <string.h>

#include "core/layout.h"
#include "core/plan.h"
#include "mok.h"
#include "test.h"

typedef struct part {
    const char *name;
    size_t offset, bytes;
} part;

/* Every part of the layout aligned, inside the region and apart from the others; without rings
 * their offsets 0. */
static void check_region(const mok_shape *s, const mok_config *c, const mok_region_spec *spec, const char *what) {
    const size_t sched_bytes = 4096 + 8 * (size_t)s->max_tokens;
    mok_region_layout L;
    mok__region_layout(&L, s, c, sched_bytes, spec);
    const size_t T = (size_t)s->max_tokens, H = (size_t)s->hidden, k = (size_t)s->topk, ring = (size_t)c->ring_rows;
    const size_t x_elem = spec->x_codes ? 1 : 2, scales = spec->x_codes ? H / MOK_FP8_BLOCK * 4 : 0;
    const int r = spec->rings;
    const part parts[] = {
        {"flags", L.flags, spec->flags_bytes},
        {"calls", L.calls, spec->calls_bytes},
        {"blob", L.blob, spec->blob_bytes},
        {"tokens", L.tokens, 8},
        {"x", L.x, T * H * x_elem},
        {"x_scale", L.x_scale, T * scales},
        {"router_w", L.router_w, T * k * 4},
        {"ids", L.ids, T * k * 4},
        {"comb", L.comb, T * k * H * 2},
        {"dy", L.dy, T * H * 2},
        {"dxbuf", L.dxbuf, T * k * H * 2},
        {"drw", L.drw, T * k * 4},
        {"sched", L.sched, r ? sched_bytes : 0},
        {"counters", L.counters, r ? (size_t)spec->counters * 8 : 0},
        {"ring_x", L.ring_x, r ? ring * H * x_elem : 0},
        {"ring_x_scale", L.ring_x_scale, r ? ring * scales : 0},
        {"ring_y", L.ring_y, r ? ring * H * 2 : 0},
        {"ring_dy", L.ring_dy, r ? ring * H * 2 : 0},
        {"ring_dyw", L.ring_dyw, r && spec->ring_dyw ? ring * H * 2 : 0},
        {"ring_w", L.ring_w, r ? ring * 4 : 0},
        {"ring_rdot", L.ring_rdot, r ? ring * (size_t)spec->rdot_cols * 4 : 0},
        {"failed", L.failed, spec->failed ? 4 : 0},
    };
    const size_t n = sizeof parts / sizeof parts[0];
    for (size_t i = 0; i < n; ++i) {
        const part *p = &parts[i];
        CHECK(p->offset % spec->align == 0, "%s: %s at %zu is not %zu-aligned", what, p->name, p->offset, spec->align);
        CHECK(p->offset + p->bytes <= L.bytes, "%s: %s ends at %zu, past the region's %zu bytes", what, p->name,
              p->offset + p->bytes, L.bytes);
        for (size_t j = 0; j < i; ++j)
            if (p->bytes && parts[j].bytes)
                CHECK(p->offset >= parts[j].offset + parts[j].bytes || parts[j].offset >= p->offset + p->bytes,
                      "%s: %s and %s overlap", what, p->name, parts[j].name);
    }
    if (!r)
        CHECK(L.sched == 0 && L.counters == 0 && L.ring_x == 0 && L.ring_y == 0 && L.ring_rdot == 0,
              "%s: without rings their offsets are 0", what);
    CHECK(L.bytes % spec->align == 0, "%s: %zu bytes", what, L.bytes);
    CHECK(L.turned == mok__config_turned(c), "%s: turned", what);
}

MOK_TEST(layout_region_parts) {
    mok_shape s;
    memset(&s, 0, sizeof s);
    s.hidden = 512;
    s.intermediate = 256;
    s.num_experts = 8;
    s.topk = 2;
    s.max_tokens = 77;
    for (int precision = 0; precision < 2; ++precision)
        for (int turn = 0; turn < 2; ++turn) {
            mok_config c = mok_config_default();
            if (turn) c.bwd_dispatch = MOK_PULL;
            s.precision = precision ? MOK_PRECISION_FP8 : MOK_PRECISION_BF16;
            const mok_region_spec cpu = {.align = 64, .x_codes = precision, .rings = 1, .rdot_cols = 4,
                                         .counters = 1000, .failed = 1};
            const mok_region_spec cuda = {.align = 256, .flags_bytes = 512, .calls_bytes = 2048, .blob_bytes = 300,
                                          .rings = turn, .ring_dyw = 1, .rdot_cols = 4,
                                          .counters = 1000 + MOK_COUNTER_EXTRA_SLOTS};
            check_region(&s, &c, &cpu, precision ? "cpu, fp8" : "cpu, bf16");
            check_region(&s, &c, &cuda, turn ? "cuda, turned" : "cuda");
        }
    CHECK(MOK_COUNTER_SLOT_TICKET + MOK_ROLE_COMPUTE < MOK_COUNTER_SLOT_ABORT &&
              MOK_COUNTER_SLOT_ABORT < MOK_COUNTER_EXTRA_SLOTS,
          "the named slots lie apart, inside the extra slots");
}

/* A pass's transfer switches: a forward's from fwd_*, a backward's from bwd_*, a recompute none;
 * the worst case has every switch the config turns. */
MOK_TEST(plan_transfer_switches) {
    mok_shape s;
    memset(&s, 0, sizeof s);
    s.hidden = 256;
    s.intermediate = 128;
    s.num_experts = 8;
    s.topk = 2;
    s.max_tokens = 64;
    mok_config c = mok_config_default();
    c.fwd_combine = MOK_PULL;
    c.fwd_dispatch = MOK_PUSH;
    c.bwd_dispatch = MOK_PULL;
    c.bwd_combine = MOK_PUSH;
    const mok_plan_workspace w = {&s, &c, 2, 128, {.n_tile = 64, .n_tile_h = 64, .wgrad_tile = 64}};
    int64_t start[5] = {0}, rows[4] = {0};
    mok_sched_header header;
    memset(&header, 0, sizeof header);
    mok_sched_view v;
    memset(&v, 0, sizeof v);
    v.header = &header;
    v.expert_start = start;
    v.expert_rows = rows;
    const mok_plan worst = mok__plan_worst(&w);
    CHECK(worst.combine_pull && worst.dispatch_push && worst.dispatch_pull && worst.combine_push, "worst: all four");
    CHECK(worst.num_local_experts == 4 && worst.nranks == 2 && worst.n_tile == 64, "worst: the workspace's");
    const int kinds[3] = {MOK_PASS_FORWARD, MOK_PASS_RECOMPUTE, MOK_PASS_BACKWARD};
    for (int i = 0; i < 3; ++i) {
        const mok_plan_pass pass = {.kind = kinds[i], .rank = 1, .num_tokens = 10, .sched = &v};
        const mok_plan p = mok__plan_pass(&w, &pass);
        const int fwd = kinds[i] == MOK_PASS_FORWARD, bwd = kinds[i] == MOK_PASS_BACKWARD;
        CHECK(p.combine_pull == fwd && p.dispatch_push == fwd && p.dispatch_pull == bwd && p.combine_push == bwd,
              "pass %d: the switches of its own transfers", kinds[i]);
        CHECK(p.backward == bwd && p.recompute == (kinds[i] == MOK_PASS_RECOMPUTE) && p.rank == 1 &&
                  p.num_tokens == 10 && p.context_rows == 128 && p.peer_padded_rows == NULL,
              "pass %d: its fields", kinds[i]);
    }
    CHECK(mok__config_turned(&c), "every transfer turned");
    const mok_config plain = mok_config_default();
    CHECK(!mok__config_turned(&plain), "the default directions turn nothing");
}
