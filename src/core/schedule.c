/* schedule.c — builds one rank's schedule (see schedule.h for the row order). Portable C: the
 * cuda backend compiles this file unchanged for the device. */
#include "schedule.h"

static MOK_HD size_t align16(size_t bytes) { return (bytes + 15u) & ~(size_t)15u; }

MOK_CORE int64_t mok__sched_max_rows(int nranks, int64_t num_local_experts, int64_t topk, int64_t max_tokens) {
    int64_t slots = (int64_t)nranks * max_tokens * topk;
    /* An expert with n rows pads to roundup(n, tile); in total at most tile - 1 extra rows per
       expert, and never more than the experts that can receive rows at all. */
    int64_t padded_experts = num_local_experts < slots ? num_local_experts : slots;
    int64_t rows = slots + padded_experts * (MOK_ROW_TILE - 1);
    return (rows + MOK_ROW_TILE - 1) / MOK_ROW_TILE * MOK_ROW_TILE;
}

MOK_CORE void mok__sched_layout(mok_sched_layout *layout, int nranks, int64_t num_local_experts, int64_t topk,
                              int64_t max_tokens) {
    size_t off = align16(sizeof(mok_sched_header));
    layout->nranks = nranks;
    layout->num_local_experts = (int)num_local_experts;
    layout->topk = (int)topk;
    layout->max_tokens = max_tokens;
    layout->max_rows = mok__sched_max_rows(nranks, num_local_experts, topk, max_tokens);
    layout->off_expert_start = off;
    off = align16(off + sizeof(int64_t) * (size_t)(num_local_experts + 1));
    layout->off_expert_rows = off;
    off = align16(off + sizeof(int64_t) * (size_t)num_local_experts);
    layout->off_counts = off;
    off = align16(off + sizeof(int64_t) * (size_t)(num_local_experts * nranks));
    layout->off_row_peer = off;
    off = align16(off + sizeof(int32_t) * (size_t)layout->max_rows);
    layout->off_row_slot = off;
    off = align16(off + sizeof(int32_t) * (size_t)layout->max_rows);
    layout->off_own_ids = off;
    off = align16(off + sizeof(int32_t) * (size_t)(max_tokens * topk));
    layout->bytes = off;
}

MOK_CORE mok_sched_view mok__sched_view(const mok_sched_layout *layout, void *buffer) {
    char *base = (char *)buffer;
    mok_sched_view view;
    view.header = (mok_sched_header *)base;
    view.expert_start = (int64_t *)(base + layout->off_expert_start);
    view.expert_rows = (int64_t *)(base + layout->off_expert_rows);
    view.counts = (int64_t *)(base + layout->off_counts);
    view.row_peer = (int32_t *)(base + layout->off_row_peer);
    view.row_slot = (int32_t *)(base + layout->off_row_slot);
    view.own_ids = (int32_t *)(base + layout->off_own_ids);
    return view;
}

MOK_CORE int mok__sched_build(const mok_sched_layout *layout, void *buffer, int rank, int64_t num_experts,
                            const int64_t *num_tokens, const int32_t *const *ids) {
    mok_sched_view v = mok__sched_view(layout, buffer);
    const int P = layout->nranks, L = layout->num_local_experts, k = layout->topk;
    const int64_t first_expert = (int64_t)rank * L;
    int error = 0;

    v.header->magic = MOK_SCHED_MAGIC;
    v.header->nranks = P;
    v.header->rank = rank;
    v.header->num_local_experts = L;
    v.header->topk = k;
    v.header->max_rows = layout->max_rows;
    for (int p = 0; p < MOK_MAX_RANKS; ++p) v.header->num_tokens[p] = p < P ? num_tokens[p] : 0;

    /* Phase 1: counts[l][p]. Ids are checked on every rank so that every rank reports a bad id
       of any rank the same way. */
    for (int64_t i = 0; i < (int64_t)L * P; ++i) v.counts[i] = 0;
    for (int p = 0; p < P; ++p) {
        if (num_tokens[p] < 0 || num_tokens[p] > layout->max_tokens) {
            error = MOK_SCHED_ERR_TOKENS;
            continue;
        }
        for (int64_t s = 0; s < num_tokens[p] * k; ++s) {
            int32_t e = ids[p][s];
            if (e < -1 || e >= num_experts) {
                error = MOK_SCHED_ERR_EXPERT_ID;
                continue;
            }
            if (e >= first_expert && e < first_expert + L) v.counts[(e - first_expert) * P + p] += 1;
        }
    }

    /* Phase 2: padded segments. */
    int64_t row = 0, routed = 0, busiest = 0;
    for (int l = 0; l < L; ++l) {
        int64_t n = 0;
        for (int p = 0; p < P; ++p) n += v.counts[l * P + p];
        v.expert_start[l] = row;
        v.expert_rows[l] = n;
        routed += n;
        if (n > busiest) busiest = n;
        row += (n + MOK_ROW_TILE - 1) / MOK_ROW_TILE * MOK_ROW_TILE;
    }
    v.expert_start[L] = row;
    if (row > layout->max_rows) {
        error = MOK_SCHED_ERR_CAPACITY;
        row = 0;
        for (int l = 0; l <= L; ++l) v.expert_start[l] = 0;
        for (int l = 0; l < L; ++l) v.expert_rows[l] = 0;
        routed = 0;
        busiest = 0;
    }
    v.header->routed_rows = routed;
    v.header->padded_rows = row;
    v.header->max_expert_rows = busiest;

    /* Phase 3: place rows. The i-th row (0-based) of peer p inside expert l goes to
       start + sum_q min(c_q, i) + #{q < p : c_q > i}: round-robin with exhausted peers skipped. */
    for (int64_t r = 0; r < row; ++r) {
        v.row_peer[r] = -1;
        v.row_slot[r] = -1;
    }
    if (v.header->padded_rows > 0) {
        for (int p = 0; p < P; ++p) {
            if (num_tokens[p] < 0 || num_tokens[p] > layout->max_tokens) continue;
            for (int l = 0; l < L; ++l) {
                const int64_t *c = v.counts + (int64_t)l * P;
                if (c[p] == 0) continue;
                int64_t i = 0;
                for (int64_t s = 0; s < num_tokens[p] * k; ++s) {
                    if (ids[p][s] != (int32_t)(first_expert + l)) continue;
                    int64_t pos = v.expert_start[l];
                    for (int q = 0; q < P; ++q) pos += c[q] < i ? c[q] : i;
                    for (int q = 0; q < p; ++q) pos += c[q] > i ? 1 : 0;
                    v.row_peer[pos] = p;
                    v.row_slot[pos] = (int32_t)s;
                    ++i;
                }
            }
        }
    }

    /* This rank's own ids, for the epilogues (which slots are empty). */
    for (int64_t s = 0; s < layout->max_tokens * k; ++s)
        v.own_ids[s] = (s < num_tokens[rank] * k && error != MOK_SCHED_ERR_TOKENS) ? ids[rank][s] : -1;

    v.header->error = error;
    return error;
}

MOK_CORE int mok__sched_row_expert(const mok_sched_view *view, int num_local_experts, int64_t row) {
    int lo = 0, hi = num_local_experts - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (view->expert_start[mid] <= row) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}
