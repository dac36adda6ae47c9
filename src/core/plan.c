/* plan.c — a workspace's shape and config as a pass's plan (plan.h). */
#include "core/plan.h"

#include <string.h>

/* The fields every pass of the workspace shares. */
static mok_plan plan_base(const mok_plan_workspace *w) {
    const mok_shape *s = w->shape;
    mok_plan p;
    memset(&p, 0, sizeof p);
    p.hidden = s->hidden;
    p.intermediate = s->intermediate;
    p.shared_intermediate = s->shared_intermediate;
    p.num_local_experts = (int)(s->num_experts / w->nranks);
    p.minibatch_rows = w->config->minibatch_rows;
    p.ring_rows = w->config->ring_rows;
    p.n_tile = w->tiles.n_tile;
    p.n_tile_h = w->tiles.n_tile_h;
    p.wgrad_tile = w->tiles.wgrad_tile;
    p.wgrad_tile_n = w->tiles.wgrad_tile_n;
    p.raster = w->tiles.raster;
    p.nranks = w->nranks;
    return p;
}

/* The transfer switches (tasks.h) of a forward's turned dispatch and combine, and of a backward's
 * turned reverse-dispatch and reverse-combine; a recompute turns none. */
static void plan_directions(mok_plan *p, const mok_config *c, int forward, int backward) {
    p->combine_pull = forward && c->fwd_combine == MOK_PULL;
    p->dispatch_push = forward && c->fwd_dispatch == MOK_PUSH;
    p->dispatch_pull = backward && c->bwd_dispatch == MOK_PULL;
    p->combine_push = backward && c->bwd_combine == MOK_PUSH;
}

mok_plan mok__plan_worst(const mok_plan_workspace *w) {
    mok_plan p = plan_base(w);
    plan_directions(&p, w->config, 1, 1);
    return p;
}

mok_plan mok__plan_pass(const mok_plan_workspace *w, const mok_plan_pass *pass) {
    mok_plan p = plan_base(w);
    p.backward = pass->kind == MOK_PASS_BACKWARD;
    p.recompute = pass->kind == MOK_PASS_RECOMPUTE;
    p.accumulate = pass->accumulate;
    p.padded_rows = pass->sched->header->padded_rows;
    p.context_rows = w->context_rows;
    p.num_tokens = pass->num_tokens;
    p.expert_start = pass->sched->expert_start;
    p.expert_rows = pass->sched->expert_rows;
    p.rank = pass->rank;
    plan_directions(&p, w->config, pass->kind == MOK_PASS_FORWARD, pass->kind == MOK_PASS_BACKWARD);
    return p;
}

mok_plan mok__plan_switches(const mok_config *config, int kind) {
    mok_plan p;
    memset(&p, 0, sizeof p);
    p.backward = kind == MOK_PASS_BACKWARD;
    p.recompute = kind == MOK_PASS_RECOMPUTE;
    plan_directions(&p, config, kind == MOK_PASS_FORWARD, kind == MOK_PASS_BACKWARD);
    return p;
}

int mok__config_turned(const mok_config *c) {
    return c->fwd_dispatch != MOK_PULL || c->fwd_combine != MOK_PUSH || c->bwd_combine != MOK_PULL ||
           c->bwd_dispatch != MOK_PUSH;
}
