/* compute_walk.cuh — the compute CTAs' task loop in warp-specialised form (COMPUTE_THREADS
 * threads): the producer warpgroup claims the role's tickets, waits on their counters and streams
 * each task's GEMM operands into the stage ring (gemm_tile.cuh); the two consumer warpgroups run
 * the GEMMs and the epilogues, then bump the done counters. The producer is already loading the
 * next task while the consumers finish this one, so a short-K tile does not start cold.
 *
 * A Runner says what a compute task is, and both sides ask it the same questions:
 *   static constexpr int VARIANTS;  bit (2 A_MN + B_MN) set for each operand layout it uses
 *   static constexpr bool FP8;      optional: true when its K-major GEMMs are block-scaled E4M3
 *                                    (fp8_tile.cuh's consumer loop; the whole kernel takes its
 *                                    register split): layout 0 then, and layout 1 for one whose B
 *                                    has a K split (tile_operands.bk_split; its operands are K-major
 *                                    too); M/N-major ones (layout 3) stay bf16
 *   prepare(p, v, span, rt, nt, &tp): producer thread 0, once per task before posting it: what
 *                                    the others need of the schedule (params.cuh's task_prep); they
 *                                    get it as `tp` (shared memory, beside the task's queue entry)
 *   gemm(p, span, rt, nt, tp, i, &op): 0 when the task has no GEMM i, else 1 + its layout;
 *                                    GEMMs 0, 1, ... run in order
 *   preset<VAR>(p, span, rt, nt, tp, i, acc): consumer side, before GEMM i: fills acc with the
 *                                      starting values (zeros, or a carried fp32 tile) on every path
 *   epilogue<VAR>(p, span, rt, nt, tp, i, acc, staging, red, maps): consumer side, after GEMM i; if
 *                                      it used `staging`, it returns with the consumers
 *                                      synchronised; consumer thread 0 may leave TMA stores from
 *                                      the staging region in flight (tma.cuh), which it waits
 *                                      for before the region is written again and at the end
 *   VAR is GEMM i's layout (2 A_MN + B_MN): each layout's consumer path is compiled apart (its
 *   own accumulators), so an epilogue needs only the task kinds whose GEMMs have that layout.
 *   Every other kind's code would be dead there, and its copies (one per layout) would fill the
 *   instruction cache.
 *   plain(p, span, rt, nt, tp): consumer side, after the GEMMs (tasks without any run only this)
 *   static constexpr bool HANDOFF;  optional: true when an epilogue may hand part of its tile to
 *                                    warps 1-3 in passes with p.handoff set (NOTE (handoff)); then
 *   handed(p, ho, staging, part): warp 1 + part (0, 1, 2), all lanes: its third of that part,
 *                                    from the staging region
 *
 * NOTE (completion): warp 3 of the producer warpgroup releases the done counters, so the
 * consumers do not wait on the gpu-scope fence: after the task's closing consumer barrier,
 * consumer thread 0 posts {span, tile, times} into a DONE_QUEUE-entry ring (cfull/cempty, count 1
 * each) and goes on; the completer waits on cfull (acquire, cta scope: the consumers' stores
 * happen before), then fences at gpu scope and releases the counters.
 *
 * NOTE (handoff): in a pass with p.handoff set (every operand by TMA, so warp 0 alone loads: full[s]
 * counts 32), a Runner with HANDOFF may leave the last part of a tile's epilogue to warps 1-3 (the
 * forward's gate|up tile: its h from the bf16 g|u the consumers put in the staging region as TMA
 * store boxes).
 * Consumer thread 0 fills the handoff slot (tile_handoff: what and where the rows go) and counts
 * it in `posted`, every consumer thread then arrives on hready (count CONSUMER_THREADS), and the
 * task is posted to the done queue as any other. Warps 1 and 2 wait on each phase of hready in
 * turn, run their third (Runner::handed) and arrive on htaken (every lane, releasing its reads and
 * stores; count 96). Warp 3 takes each done-queue entry; for one that carries a handoff it does the
 * same with its third, then waits for htaken's phase (all three thirds stored: acquire, cta scope)
 * before it releases the task's counters. At most one handoff is outstanding: every epilogue of a
 * Runner first waits on htaken for the last one posted (handoff_wait), since it writes the
 * staging region. On leaving, the consumers post a last phase of hready with the slot's stop set,
 * which ends warps 1 and 2; warp 3 ends on the done queue's stop entry. No wait here can deadlock:
 * the workers wait only on hready, which every handoff and the stop post complete, and every
 * wait returns on abort. The workers' wait has no timeout (mbar_wait_idle): it spans the CTA's
 * other tasks, the rank's own work, and the consumers reach their stop post whatever happens,
 * every wait of theirs being bounded.
 *
 * NOTE (queue): tasks pass from producer to consumers through a 2-entry queue in shared memory:
 * qfull[q] (count 1, producer thread 0 arrives after writing entry q), qempty[q] (count 1,
 * consumer thread 0 arrives once every consumer has read it). Entry q's task_prep (prep[q])
 * travels with it: written by producer thread 0 before qfull[q], read by the loaders after the
 * producer barrier that follows and by the consumers until their qempty[q] arrive. Thread 0
 * writes prep[q] again (task n + 2) only after that arrive and after the producer barrier of
 * task n + 1, which every loader reaches having done with task n. A producer holds at most the
 * queued tasks beyond the one running; it claims tickets in increasing order and posts a task
 * only after its counter waits pass, and every stage a posted task needs is loaded before the
 * next ticket is claimed, so the pass stays deadlock-free with every CTA resident. */
#ifndef MOK_CUDA_WALK_WS_CUH
#define MOK_CUDA_WALK_WS_CUH

#include "cuda/megakernel/task_list.cuh"
#include "cuda/sm90/fp8_tile.cuh"
#include "cuda/sm90/gemm_tile.cuh"

struct queued_task {
    long long g, rt, nt;
    long long stop;
};

/* config.trace: a task's time inside its GEMM main loops and when the last one ended. */
struct task_clock {
    long long gemm_ns, gemm_end;
};

struct done_task { /* a finished task, for the completer */
    long long g, rt, start, end, gemm_ns, gemm_end;
    long long stop, handed; /* handed: the task left part of its epilogue to warps 1-3 */
};
#define DONE_QUEUE 4

/* The part of an epilogue handed to warps 1-3 (NOTE (handoff)): `rows` rows of `cols` bf16
 * values to out (row r at out + r * ld), computed as the Runner's `handed` knows (forward.cu: h
 * from g|u, swiglu.cuh's swiglu_handed). posted counts the handoffs so far, stop ends the workers
 * (consumer thread 0 writes both). */
struct tile_handoff {
    uint16_t *out;
    long long ld;
    int rows, cols;
    unsigned posted, stop;
};
#define HANDOFF_PARTS 3 /* warps 1-3 */

/* Shared memory of a warp-specialised CTA, from a 1024-byte aligned base: the stage ring, the
 * staging tile, the dh scratch (right after the staging tile: one 64-column chunk of a
 * SwiGLU-backward tile's fp32 dh, [TILE_BM][DH_SCRATCH_LD], then TILE_BM per-row sums and TILE_BM
 * router weights; backward.cu),
 * the mbarriers (full, empty, qfull, qempty, cfull, cempty, hready, htaken), the queues, the
 * handoff slot, the task preps, the schedule's experts, the stages' scale slots (FP8,
 * gemm_tile.cuh). */
#define SMEM_STAGING_OFF (RING_STAGES * STAGE_BYTES)
#define SMEM_STAGING_BYTES (TILE_BM * TILE_C_LD * 2)
#define DH_SCRATCH_LD 68 /* floats: 64 columns, padded */
#define DH_SCRATCH_BYTES ((TILE_BM * DH_SCRATCH_LD + 2 * TILE_BM) * 4)
#define SMEM_BARRIERS_OFF (SMEM_STAGING_OFF + SMEM_STAGING_BYTES + DH_SCRATCH_BYTES)
/* A weight-gradient tile stored by TMA (backward.cu) occupies the staging tile and the dh scratch
 * as four 128-row x 64-column bf16 boxes (STORE_BOX_BYTES, gemm_tile.cuh), each 1024-byte
 * aligned for the 128B swizzle. */
static_assert(4 * STORE_BOX_BYTES <= SMEM_STAGING_BYTES + DH_SCRATCH_BYTES && SMEM_STAGING_OFF % 1024 == 0,
              "the TMA store boxes fit the staging region");
#define SMEM_HANDOFF_BARS_OFF (SMEM_BARRIERS_OFF + 8 * (2 * RING_STAGES + 4 + 2 * DONE_QUEUE)) /* hready, htaken */
#define SMEM_QUEUE_OFF (SMEM_HANDOFF_BARS_OFF + 16)
#define SMEM_DONE_QUEUE_OFF (SMEM_QUEUE_OFF + 2 * (int)sizeof(queued_task))
#define SMEM_HANDOFF_OFF ((SMEM_DONE_QUEUE_OFF + DONE_QUEUE * (int)sizeof(done_task) + 15) / 16 * 16)
#define SMEM_PREP_OFF ((SMEM_HANDOFF_OFF + (int)sizeof(tile_handoff) + 15) / 16 * 16)
/* The schedule's expert_start [E + 1] and expert_rows [E] (int64), copied at the CTA's start when
 * E <= SMEM_EXPERTS_MAX: the producer's row_tile and weight-gradient prep search and read them for
 * every task, and from global memory each step of that search would miss L1 (the counter acquire
 * before it empties L1): a dependent L2 round trip per step, on its way to posting the task. */
#define SMEM_EXPERTS_MAX 512
#define SMEM_EXPERTS_OFF (SMEM_PREP_OFF + 2 * (int)sizeof(task_prep))
#define SMEM_SCALES_OFF ((SMEM_EXPERTS_OFF + (2 * SMEM_EXPERTS_MAX + 1) * 8 + 15) / 16 * 16)
#define COMPUTE_SMEM_BYTES (1024 + SMEM_SCALES_OFF + RING_STAGES * STAGE_SCALE_BYTES)
static_assert(COMPUTE_SMEM_BYTES <= 227 * 1024, "a compute CTA's shared memory exceeds the 227 KB an SM gives one block");

/* The shared-memory addresses a warp-specialised CTA's roles share. */
struct compute_shared {
    uint32_t qfull, qempty, cfull, cempty;
    volatile queued_task *queue;
    volatile done_task *cq;
    task_prep *prep; /* [2], one per queue entry */
};

/* An epilogue's view of the handoff (NOTE (handoff)), from the staging region it is given (at
 * SMEM_STAGING_OFF of the CTA's aligned base). */
struct handoff_view {
    volatile tile_handoff *slot;
    uint32_t ready, taken;
};
static __device__ __forceinline__ handoff_view handoff_of(uint16_t *staging) {
    uint8_t *base = (uint8_t *)staging - SMEM_STAGING_OFF;
    const uint32_t b = (uint32_t)__cvta_generic_to_shared(base);
    return {(volatile tile_handoff *)(base + SMEM_HANDOFF_OFF), b + SMEM_HANDOFF_BARS_OFF, b + SMEM_HANDOFF_BARS_OFF + 8};
}

/* Consumer thread 0: the next handoff into the slot (the other fields of tile_handoff), counted in
 * `posted`; every consumer thread then arrives on hready. */
static __device__ __forceinline__ void handoff_fill(const handoff_view &hv, uint16_t *out, long long ld, int rows,
                                                    int cols) {
    hv.slot->out = out;
    hv.slot->ld = ld;
    hv.slot->rows = rows;
    hv.slot->cols = cols;
    hv.slot->posted = hv.slot->posted + 1;
}

/* Consumers, every thread, before an epilogue of a HANDOFF Runner writes the staging region:
 * warps 1-3 have read the last handoff from it (a CTA with none posted passes at once). */
static __device__ __forceinline__ void handoff_wait(const handoff_view &hv, unsigned long long *abort, int *error,
                                                    long long timeout_ns) {
    const unsigned k = hv.slot->posted;
    if (k > 0) mbar_wait(hv.taken, (k - 1) & 1, abort, error, timeout_ns);
}

/* Host: the weights' maps (boxes of 64 x 64, read K-major in the forward, N-major in the dgrad)
 * and the mask of those usable. */
static unsigned weight_maps(const pass_params *p, pass_maps *maps) {
    const long long H = p->hidden, I = p->inter, Is = p->shared_inter, E = p->num_local_experts;
    unsigned mask = 0;
    mask |= (unsigned)tma_encode(&maps->m[MAP_W_GATE], p->w_gate, E * I, H, 64) << MAP_W_GATE;
    mask |= (unsigned)tma_encode(&maps->m[MAP_W_UP], p->w_up, E * I, H, 64) << MAP_W_UP;
    mask |= (unsigned)tma_encode(&maps->m[MAP_W_DOWN], p->w_down, E * H, I, 64) << MAP_W_DOWN;
    mask |= (unsigned)tma_encode(&maps->m[MAP_S_GATE], Is ? p->s_gate : NULL, Is, H, 64) << MAP_S_GATE;
    mask |= (unsigned)tma_encode(&maps->m[MAP_S_UP], Is ? p->s_up : NULL, Is, H, 64) << MAP_S_UP;
    mask |= (unsigned)tma_encode(&maps->m[MAP_S_DOWN], Is ? p->s_down : NULL, H, Is, 64) << MAP_S_DOWN;
    return mask;
}

/* TMA for a GEMM with K-major B when its maps are usable (else the cp.async path runs):
 * A rows a_row.. of a_map; B's op->n_valid rows in 64-row blocks, the first op->b_split from
 * rows row_lo.. of b_lo, the rest from rows row_hi.. of b_hi (a gate|up tile's two weights). */
static __device__ __forceinline__ void use_tma_k(const pass_params &p, tile_operands *op, int a_map, long long a_row,
                                                 int b_lo, long long row_lo, int b_hi, long long row_hi) {
    const unsigned need = (1u << a_map) | (1u << b_lo) | (1u << b_hi);
    if ((p.tma_mask & need) != need) return;
    op->tma = 1;
    op->a_map = a_map;
    op->a_row = (int)a_row;
    op->a_mmajor = 0;
    op->a_halves = 2;
    op->b_nmajor = 0;
    op->b_halves = (op->n_valid + 63) / 64;
    op->b_map[0] = b_lo;
    op->b_row[0] = (int)row_lo;
    op->b_map[1] = b_hi;
    op->b_row[1] = (int)row_hi;
}

/* The same with all of B from rows b_row.. of one map. */
static __device__ __forceinline__ void use_tma_k(const pass_params &p, tile_operands *op, int a_map, long long a_row,
                                                 int b_map, long long b_row) {
    use_tma_k(p, op, a_map, a_row, b_map, b_row, b_map, 0);
}

/* TMA for a GEMM with N-major B (columns col.., `halves` 64-column halves): k rows from row0 of
 * b0 while k < op->k_split, from row1 of b1 after (a dx tile's gate and up weights). */
static __device__ __forceinline__ void use_tma_n(const pass_params &p, tile_operands *op, int a_map, long long a_row,
                                                 int b0, long long row0, int b1, long long row1, long long col,
                                                 int halves) {
    const unsigned need = (1u << a_map) | (1u << b0) | (1u << b1);
    if ((p.tma_mask & need) != need) return;
    op->tma = 1;
    op->a_map = a_map;
    op->a_row = (int)a_row;
    op->a_mmajor = 0;
    op->a_halves = 2;
    op->b_nmajor = 1;
    op->b_halves = halves;
    op->b_col = (int)col;
    op->b_map[0] = b0;
    op->b_row[0] = (int)row0;
    op->b_map[1] = b1;
    op->b_row[1] = (int)row1;
}

/* The same with every k row of B from row b_row.. of one map. */
static __device__ __forceinline__ void use_tma_n(const pass_params &p, tile_operands *op, int a_map, long long a_row,
                                                 int b_map, long long b_row, long long col, int halves) {
    use_tma_n(p, op, a_map, a_row, b_map, b_row, b_map, 0, col, halves);
}

/* TMA for a weight-gradient GEMM: A M-major (k rows from a_row, columns a_col.., `a_halves`
 * halves), B N-major (k rows from b_row, columns b_col.., `b_halves` halves), one k range. */
static __device__ __forceinline__ void use_tma_mn(const pass_params &p, tile_operands *op, int a_map, long long a_row,
                                                  long long a_col, int a_halves, int b_map, long long b_row,
                                                  long long b_col, int b_halves) {
    const unsigned need = (1u << a_map) | (1u << b_map);
    if ((p.tma_mask & need) != need) return;
    op->tma = 1;
    op->a_map = a_map;
    op->a_row = (int)a_row;
    op->a_mmajor = 1;
    op->a_halves = a_halves;
    op->a_col = (int)a_col;
    op->b_nmajor = 1;
    op->b_halves = b_halves;
    op->b_col = (int)b_col;
    op->b_map[0] = op->b_map[1] = b_map;
    op->b_row[0] = op->b_row[1] = (int)b_row;
}

/* Whether a Runner's GEMMs are FP8 (its `static constexpr bool FP8 = true`; bf16 without the member):
 * their consumers run fp8_tile.cuh's block-scaled loop on the same stages. */
template <typename Runner, typename = void>
struct runner_fp8 {
    static constexpr bool value = false;
};
template <typename Runner>
struct runner_fp8<Runner, decltype((void)Runner::FP8)> {
    static constexpr bool value = Runner::FP8;
};

/* Whether a Runner hands epilogue parts to warps 1-3 (its `static constexpr bool HANDOFF = true`);
 * a pass does only where p.handoff is set too (handoff_on). */
template <typename Runner, typename = void>
struct runner_handoff {
    static constexpr bool value = false;
};
template <typename Runner>
struct runner_handoff<Runner, decltype((void)Runner::HANDOFF)> {
    static constexpr bool value = Runner::HANDOFF;
};
template <typename Runner>
static __device__ __forceinline__ bool handoff_on(const pass_params &p) {
    return runner_handoff<Runner>::value && p.handoff;
}

template <typename Runner, bool A_MN, bool B_MN>
static __device__ __forceinline__ bool variant_used(int variant) {
    return variant == (A_MN ? 2 : 0) + (B_MN ? 1 : 0) && ((Runner::VARIANTS >> variant) & 1);
}

template <typename Runner>
static __device__ void produce(stage_ring &r, int variant, const tile_operands &op, int tid) {
    /* an FP8 runner's E4M3 GEMMs: layouts 0 and 1, both K-major, B maybe split along K; its
       layout 3 (the weight gradients) is bf16 and carries no scales */
    const bool e4m3 = runner_fp8<Runner>::value && (variant_used<Runner, false, false>(variant) ||
                                                    variant_used<Runner, false, true>(variant));
    if (op.tma && e4m3) produce_tma<true>(r, op, tid);
    else if (op.tma) produce_tma<false>(r, op, tid);
    else if (e4m3) produce_gemm<false, false, true>(r, op, tid);
    else if (variant_used<Runner, false, false>(variant)) produce_gemm<false, false>(r, op, tid);
    else if (variant_used<Runner, false, true>(variant)) produce_gemm<false, true>(r, op, tid);
    else if (variant_used<Runner, true, false>(variant)) produce_gemm<true, false>(r, op, tid);
    else if (variant_used<Runner, true, true>(variant)) produce_gemm<true, true>(r, op, tid);
}

/* Consumers, GEMM i of a task: preset, multiply, epilogue. One instantiation per operand layout,
 * each with its own accumulators: merging them across layouts makes ptxas serialise the wgmmas. */
template <typename Runner, bool A_MN, bool B_MN>
static __device__ __forceinline__ void consume_phase(const pass_params &p, const mok_task_span &span, long long rt,
                                                long long nt, const task_prep &tp, int i, stage_ring &r, const tile_operands &op,
                                                uint16_t *staging, float *red, task_clock &clk) {
    float acc[TILE_ACC];
    Runner::template preset<(A_MN ? 2 : 0) + (B_MN ? 1 : 0)>(p, span, rt, nt, tp, i, acc);
    const long long g0 = TRACE_ON(p) ? globaltimer_ns() : 0;
    /* an FP8 runner's K-major GEMMs are E4M3 (layout 1: B split along K); the backward's weight
       gradients stay bf16 (M/N-major) */
    if constexpr (runner_fp8<Runner>::value && !A_MN) consume_gemm_fp8(r, op, acc);
    else consume_gemm<A_MN, B_MN>(r, op, acc);
    if (TRACE_ON(p)) {
        clk.gemm_end = globaltimer_ns();
        clk.gemm_ns += clk.gemm_end - g0;
    }
    Runner::template epilogue<(A_MN ? 2 : 0) + (B_MN ? 1 : 0)>(p, span, rt, nt, tp, i, acc, staging, red, r.maps);
}

template <typename Runner>
static __device__ __forceinline__ void consume(const pass_params &p, const mok_task_span &span, long long rt,
                                  long long nt, const task_prep &tp, int i, stage_ring &r, int variant, const tile_operands &op,
                                  uint16_t *staging, float *red, task_clock &clk) {
    if (variant_used<Runner, false, false>(variant))
        consume_phase<Runner, false, false>(p, span, rt, nt, tp, i, r, op, staging, red, clk);
    else if (variant_used<Runner, false, true>(variant))
        consume_phase<Runner, false, true>(p, span, rt, nt, tp, i, r, op, staging, red, clk);
    else if (variant_used<Runner, true, false>(variant))
        consume_phase<Runner, true, false>(p, span, rt, nt, tp, i, r, op, staging, red, clk);
    else if (variant_used<Runner, true, true>(variant))
        consume_phase<Runner, true, true>(p, span, rt, nt, tp, i, r, op, staging, red, clk);
}

template <typename Runner>
static __device__ void producer_loop(const pass_params &p, const mok_sched_view &v, stage_ring r, const compute_shared &sh,
                                     int loaders) {
    const uint32_t qfull = sh.qfull, qempty = sh.qempty;
    volatile queued_task *queue = sh.queue;
    const int tid = threadIdx.x;
    unsigned long long *ticket = p.counters + p.counters_cap + MOK_COUNTER_SLOT_TICKET + MOK_ROLE_COMPUTE;
    task_cursor cur = TASK_CURSOR_START;
    /* The next ticket is claimed as soon as the current task is posted: the atomic's round trip
       then overlaps the current task's loads instead of delaying the next task's. */
    unsigned long long next = tid == 0 ? atomicAdd(ticket, 1ull) : 0;
    counter_seen seen = {-1, 0}; /* thread 0: the last wait[0] counter it waited on (counters.cuh) */
    for (long long n = 0;; ++n) {
        const int q = (int)(n & 1);
        if (tid == 0) {
            long long g = 0, rt = 0, nt = 0, stop = 1;
            const long long t = (long long)next;
            task_prep tp = {};
            if (cursor_seek(p, MOK_ROLE_COMPUTE, cur, t)) {
                const mok_task_span span = p.spans[cur.g];
                long long wait;
                task_decode(span, t - cur.g_first, &rt, &nt, &wait);
                g = cur.g;
                tp.span = span;
                Runner::prepare(p, v, span, rt, nt, &tp);
                /* compute tasks wait on their own rank's counters, most on wait[0] alone */
                stop = !(wait_counter_seen(p, wait, span.target[0], &seen) &&
                         wait_counter_thread(p, span.wait[1], span.target[1]));
            }
            mbar_wait(qempty + 8 * q, (uint32_t)((n >> 1) & 1) ^ 1, r.abort, r.error, r.timeout_ns);
            if (!stop) sh.prep[q] = tp;
            queue[q].g = g;
            queue[q].rt = rt;
            queue[q].nt = nt;
            queue[q].stop = stop;
            mbar_arrive(qfull + 8 * q);
            if (!stop) next = atomicAdd(ticket, 1ull);
        }
        producer_sync(loaders);
        if (queue[q].stop) break;
        const long long rt = queue[q].rt, nt = queue[q].nt;
        const task_prep &tp = sh.prep[q];
        const mok_task_span &span = tp.span;
        for (int i = 0;; ++i) {
            tile_operands op;
            const int kind = Runner::gemm(p, span, rt, nt, tp, i, &op);
            if (!kind) break;
            produce<Runner>(r, kind - 1, op, tid);
        }
    }
    cp_async_wait_all();
}

template <typename Runner>
static __device__ __forceinline__ void consumer_loop(const pass_params &p, stage_ring r, const compute_shared &sh,
                                        uint16_t *staging, float *red) {
    __shared__ int s_stop;
    const int ctid = threadIdx.x - PRODUCER_THREADS;
    long long ncq = 0; /* records posted to the completer (meaningful in consumer thread 0) */
    const handoff_view hv = handoff_of(staging);
    unsigned posted_seen = 0; /* consumer thread 0: handoffs posted before this task */
    for (long long n = 0;; ++n) {
        const int q = (int)(n & 1);
        if (ctid == 0) {
            mbar_wait(sh.qfull + 8 * q, (uint32_t)((n >> 1) & 1), r.abort, r.error, r.timeout_ns);
            s_stop = sh.queue[q].stop || *(volatile unsigned long long *)r.abort;
        }
        consumer_sync();
        const bool stop = s_stop;
        const long long g = sh.queue[q].g, rt = sh.queue[q].rt, nt = sh.queue[q].nt;
        const long long start = TRACE_ON(p) ? globaltimer_ns() : 0;
        task_clock clk = {0, 0};
        if (!stop) {
            const task_prep &tp = sh.prep[q];
            const mok_task_span &span = tp.span;
            for (int i = 0;; ++i) {
                tile_operands op;
                const int kind = Runner::gemm(p, span, rt, nt, tp, i, &op);
                if (!kind) break;
                consume<Runner>(p, span, rt, nt, tp, i, r, kind - 1, op, staging, red, clk);
            }
            Runner::plain(p, span, rt, nt, tp);
        }
        consumer_sync(); /* every consumer's stores of the task are done; s_stop and entry q are read */
        if (ctid == 0) {
            if (!stop) mbar_arrive(sh.qempty + 8 * q);
            const int c = (int)(ncq % DONE_QUEUE);
            mbar_wait(sh.cempty + 8 * c, (uint32_t)((ncq / DONE_QUEUE) & 1) ^ 1, r.abort, r.error, r.timeout_ns);
            sh.cq[c].g = g;
            sh.cq[c].rt = rt;
            sh.cq[c].start = start;
            sh.cq[c].end = TRACE_ON(p) ? globaltimer_ns() : 0;
            sh.cq[c].gemm_ns = clk.gemm_ns;
            sh.cq[c].gemm_end = clk.gemm_end;
            sh.cq[c].stop = stop;
            if constexpr (runner_handoff<Runner>::value) { /* did this task post a handoff? */
                const unsigned posted = hv.slot->posted;
                sh.cq[c].handed = posted != posted_seen;
                posted_seen = posted;
            } else {
                sh.cq[c].handed = 0;
            }
            mbar_arrive(sh.cfull + 8 * c);
            ++ncq;
        }
        if (stop) break;
    }
    if (handoff_on<Runner>(p)) { /* the workers' stop, once they have read the last handoff */
        handoff_wait(hv, r.abort, r.error, r.timeout_ns);
        if (ctid == 0) hv.slot->stop = 1;
        mbar_arrive(hv.ready);
    }
    if (threadIdx.x == PRODUCER_THREADS) bulk_wait(); /* the epilogues' TMA stores are done */
}

/* A handoff's third `part` (warp 1 + part, every lane; NOTE (handoff)), its `k`th (from 0): waits
 * for it on hready, runs it, and arrives on htaken. False when the pass is stopping or aborted. */
template <typename Runner>
static __device__ __forceinline__ bool handoff_take(const pass_params &p, const stage_ring &r, const handoff_view &hv,
                                                    const uint16_t *staging, unsigned k, int part) {
    /* every lane acquires the consumers' staging writes and the slot through hready; the wait
       spans the CTA's other tasks, so it has no timeout (the consumers' stop post ends it) */
    mbar_wait_idle(hv.ready, k & 1, r.abort);
    const bool go = __all_sync(0xffffffffu, *(volatile unsigned long long *)r.abort == 0 && hv.slot->stop == 0);
    if (go) {
        tile_handoff ho;
        ho.out = hv.slot->out;
        ho.ld = hv.slot->ld;
        ho.rows = hv.slot->rows;
        ho.cols = hv.slot->cols;
        if constexpr (runner_handoff<Runner>::value) Runner::handed(p, ho, staging, part);
    }
    mbar_arrive(hv.taken); /* every lane: its reads of the slot and the boxes, its rows of h */
    return go;
}

/* Warps 1 and 2 in a pass that hands off (NOTE (handoff)): their thirds of every handoff, until
 * the consumers' stop post. */
template <typename Runner>
static __device__ void handoff_loop(const pass_params &p, const stage_ring &r, uint16_t *staging, int part) {
    const handoff_view hv = handoff_of(staging);
    for (unsigned k = 0;; ++k)
        if (!handoff_take<Runner>(p, r, hv, staging, k, part)) break;
}

/* Warp 3 of the producer warpgroup: releases the done counters of finished tasks (lane 0), after
 * its third of the part of the task's epilogue handed off, if any, and the other two thirds
 * (every lane; NOTE (handoff)). Lane 0 alone reads the done queue and tells the others, so the
 * warp stays converged. */
template <typename Runner>
static __device__ void completer_loop(const pass_params &p, const stage_ring &r, const compute_shared &sh,
                                      uint16_t *staging) {
    const bool HANDOFF = handoff_on<Runner>(p);
    const int lane = threadIdx.x & 31;
    if (!HANDOFF && lane != 0) return;
    const handoff_view hv = handoff_of(staging);
    unsigned taken = 0; /* handoffs run */
    for (long long n = 0;; ++n) {
        const int c = (int)(n % DONE_QUEUE);
        long long g = 0, rt = 0, start = 0, end = 0, gemm_ns = 0, epi_ns = 0;
        int stop = 1, handed = 0;
        if (lane == 0) {
            mbar_wait(sh.cfull + 8 * c, (uint32_t)((n / DONE_QUEUE) & 1), r.abort, r.error, r.timeout_ns);
            stop = sh.cq[c].stop || *(volatile unsigned long long *)r.abort;
            if (!stop) {
                g = sh.cq[c].g;
                rt = sh.cq[c].rt;
                start = sh.cq[c].start;
                end = sh.cq[c].end;
                gemm_ns = sh.cq[c].gemm_ns;
                epi_ns = sh.cq[c].gemm_end ? end - sh.cq[c].gemm_end : 0;
                handed = (int)sh.cq[c].handed;
                mbar_arrive(sh.cempty + 8 * c);
            }
        }
        if (HANDOFF) {
            stop = __shfl_sync(0xffffffffu, stop, 0);
            handed = __shfl_sync(0xffffffffu, handed, 0);
        }
        if (stop) break;
        if (HANDOFF && handed) {
            handoff_take<Runner>(p, r, hv, staging, taken, HANDOFF_PARTS - 1);
            /* the other thirds' h rows are stored before the task's release (acquire, cta scope) */
            if (lane == 0) mbar_wait(hv.taken, taken & 1, r.abort, r.error, r.timeout_ns);
            ++taken;
        }
        if (lane == 0) finish_task(p, p.spans[g], rt, MOK_ROLE_COMPUTE, start, end, gemm_ns, epi_ns);
    }
}

/* The compute CTA: set up the ring and the queue, then split into producer and consumers. */
template <typename Runner>
static __device__ __forceinline__ void walk_compute(const pass_params &p, const mok_sched_view &v, uint8_t *smem_raw, float *red,
                                       const CUtensorMap *maps) {
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t base = (raw + 1023u) & ~1023u;
    uint8_t *aligned = smem_raw + (base - raw);
    stage_ring r;
    r.stages = base;
    r.full = base + SMEM_BARRIERS_OFF;
    r.empty = r.full + 8 * RING_STAGES;
    r.stage = 0;
    r.phase = 0;
    r.abort = p.counters + p.counters_cap + MOK_COUNTER_SLOT_ABORT;
    r.error = p.error;
    r.timeout_ns = p.timeout_ns;
    r.maps = maps;
    r.scales = base + SMEM_SCALES_OFF;
    compute_shared sh;
    sh.qfull = r.empty + 8 * RING_STAGES;
    sh.qempty = sh.qfull + 16;
    sh.cfull = sh.qempty + 16;
    sh.cempty = sh.cfull + 8 * DONE_QUEUE;
    sh.queue = (volatile queued_task *)(aligned + SMEM_QUEUE_OFF);
    sh.cq = (volatile done_task *)(aligned + SMEM_DONE_QUEUE_OFF);
    sh.prep = (task_prep *)(aligned + SMEM_PREP_OFF);
    const int loaders = handoff_on<Runner>(p) ? 32 : LOADER_THREADS; /* NOTE (handoff) */
    if (threadIdx.x == 0) {
        for (int s = 0; s < RING_STAGES; ++s) {
            mbar_init(r.full + 8 * s, loaders);
            mbar_init(r.empty + 8 * s, CONSUMER_THREADS / 32);
        }
        for (int q = 0; q < 2; ++q) {
            mbar_init(sh.qfull + 8 * q, 1);
            mbar_init(sh.qempty + 8 * q, 1);
        }
        for (int c = 0; c < DONE_QUEUE; ++c) {
            mbar_init(sh.cfull + 8 * c, 1);
            mbar_init(sh.cempty + 8 * c, 1);
        }
        const handoff_view hv = handoff_of((uint16_t *)(aligned + SMEM_STAGING_OFF));
        mbar_init(hv.ready, CONSUMER_THREADS);
        mbar_init(hv.taken, 32 * HANDOFF_PARTS);
        hv.slot->posted = 0;
        hv.slot->stop = 0;
        mbar_init_fence();
    }
    /* the producer's view: the experts' starts and rows in shared memory when they fit (the
       schedule does not change during the pass) */
    mok_sched_view vs = v;
    const int E = p.num_local_experts;
    if (E <= SMEM_EXPERTS_MAX) {
        int64_t *starts = (int64_t *)(aligned + SMEM_EXPERTS_OFF), *rows = starts + E + 1;
        for (int i = threadIdx.x; i <= E; i += blockDim.x) starts[i] = v.expert_start[i];
        for (int i = threadIdx.x; i < E; i += blockDim.x) rows[i] = v.expert_rows[i];
        vs.expert_start = starts;
        vs.expert_rows = rows;
    }
    __syncthreads(); /* the last CTA-wide barrier: the roles part here */
    /* Warp indices through a shuffle: the compiler then knows the branches are warp-uniform and
       keeps the consumers' wgmmas asynchronous. */
    const int warp = __shfl_sync(0xffffffffu, (int)(threadIdx.x / 32), 0);
    if (warp < PRODUCER_THREADS / 32) {
        /* the whole producer warpgroup, before its warps part */
        if constexpr (runner_fp8<Runner>::value) setmaxnreg_dec<FP8_PRODUCER_REGS>();
        else setmaxnreg_dec_producer();
        uint16_t *staging = (uint16_t *)(aligned + SMEM_STAGING_OFF);
        if (warp < loaders / 32) producer_loop<Runner>(p, vs, r, sh, loaders);
        else if (warp < LOADER_THREADS / 32) handoff_loop<Runner>(p, r, staging, warp - 1);
        else completer_loop<Runner>(p, r, sh, staging);
    } else {
        if constexpr (runner_fp8<Runner>::value) setmaxnreg_inc<FP8_CONSUMER_REGS>();
        else setmaxnreg_inc_consumer();
        consumer_loop<Runner>(p, r, sh, (uint16_t *)(aligned + SMEM_STAGING_OFF), red);
    }
}

#endif
