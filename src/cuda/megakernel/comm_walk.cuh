/* comm_walk.cuh — the comm CTAs: their task loop (every thread of the CTA on one task at a time)
 * and how a comm task moves the rows of a row tile (dispatch, combine, pull, push, gather,
 * scatter): one warp per row, each lane keeping four 16-byte loads in flight before it stores.
 *
 * NOTE (rate, dev/copy_rows.cu): an SM copies scattered rows at about the same rate whatever the
 * method: warps with 4 loads in flight per lane, bulk copies into shared-memory slots read by
 * storing warps, or bulk copies in and out (slower for rows of a few KB, each bulk copy having a
 * fixed cost). So the rate of a pass's data movement is set by the number of comm CTAs, not by
 * how each one copies (tuning.h: mok__cuda_comm_ctas). */
#ifndef MOK_CUDA_MEGAKERNEL_COMM_WALK_CUH
#define MOK_CUDA_MEGAKERNEL_COMM_WALK_CUH

#include "cuda/fp8_rows.cuh"
#include "cuda/megakernel/task_list.cuh"

/* The CTA loop: claim a ticket of this CTA's role, find its span and task, wait, run, bump. */
template <typename Runner>
static __device__ void walk_tasks(const pass_params &p, const mok_sched_view &v, uint16_t *smem) {
    __shared__ long long s_g, s_local; /* the task's span (-1: none, stop) and its index there */
    __shared__ int s_flag;
    const int role = MOK_ROLE_COMM; /* compute CTAs run walk_compute (compute_walk.cuh) */
    unsigned long long *ticket = p.counters + p.counters_cap + MOK_COUNTER_SLOT_TICKET + role;
    task_cursor cur = TASK_CURSOR_START; /* thread 0's */
    for (;;) {
        if (threadIdx.x == 0) {
            const long long t = (long long)atomicAdd(ticket, 1ull);
            s_g = cursor_seek(p, role, cur, t) ? cur.g : -1;
            s_local = t - cur.g_first;
        }
        __syncthreads();
        const long long g = s_g, local = s_local;
        __syncthreads();
        if (g < 0) break;
        const mok_task_span span = p.spans[g];
        long long rt, nt, wait;
        task_decode(span, local, &rt, &nt, &wait);
        if (!wait_counter(p, wait, span.target[0], &s_flag, span.wait_peer)) break;
        if (!wait_counter(p, span.wait[1], span.target[1], &s_flag)) break;
        const long long start = TRACE_ON(p) ? globaltimer_ns() : 0;
        Runner::run(p, v, span, rt, nt, smem);
        __syncthreads();
        if (threadIdx.x == 0) finish_task(p, span, rt, role, start, TRACE_ON(p) ? globaltimer_ns() : 0);
    }
}

/* The source rank and (token, slot) of a row tile's 128 rows, as a comm task moves them: loaded
 * by the first 128 threads at once into the comm CTA's shared memory, so that the warps'
 * row loops start without a dependent global load (or two, through NVLink for a peer's schedule)
 * per row, and without row_tile's binary search over the experts: padding rows (peer -1) are
 * the rows past the tile's real ones (schedule.h). The CTA's task loop syncs after every task,
 * so the next task's load does not overtake this one's readers. */
struct comm_tile {
    int32_t peer[MOK_ROW_TILE];
    int32_t slot[MOK_ROW_TILE];
};

static __device__ __forceinline__ void comm_tile_load(comm_tile *ct, const mok_sched_view &v, long long rt) {
    if (threadIdx.x < MOK_ROW_TILE) {
        const long long row = rt * MOK_ROW_TILE + threadIdx.x;
        const int32_t peer = v.row_peer[row], slot = v.row_slot[row];
        ct->peer[threadIdx.x] = peer;
        ct->slot[threadIdx.x] = slot;
    }
    __syncthreads();
}

/* One warp: a row of h bf16 from src to dst, 16 bytes per lane, 4 loads in flight. */
static __device__ __forceinline__ void copy_row(uint16_t *dst, const uint16_t *src, long long h) {
    const int4 *s = (const int4 *)src;
    int4 *d = (int4 *)dst;
    const int lane = threadIdx.x & 31, n = (int)(h / 8);
    int c = lane;
    for (; c + 96 < n; c += 128) {
        int4 v0 = s[c], v1 = s[c + 32], v2 = s[c + 64], v3 = s[c + 96];
        d[c] = v0; d[c + 32] = v1; d[c + 64] = v2; d[c + 96] = v3;
    }
    for (; c < n; c += 32) d[c] = s[c];
}

static __device__ __forceinline__ int4 scale_bf16x8(int4 a, float w) {
    uint16_t e[8];
    float f[8];
    *(int4 *)e = a;
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = w * mok__bf16_to_f32(e[i]);
    return bf16x8_from_f32(f);
}

/* One warp: a row of x and of dy (h bf16 each) to x_out and dy_out, and bf16(w * dy) to
 * dyw_out; two 16-byte loads of each in flight per lane. */
static __device__ __forceinline__ void pull_row(uint16_t *x_out, uint16_t *dy_out, uint16_t *dyw_out,
                                                const uint16_t *x, const uint16_t *dy, float w, long long h) {
    const int4 *xs = (const int4 *)x, *ds = (const int4 *)dy;
    int4 *xd = (int4 *)x_out, *dd = (int4 *)dy_out, *wd = (int4 *)dyw_out;
    const int lane = threadIdx.x & 31, n = (int)(h / 8);
    int c = lane;
    for (; c + 32 < n; c += 64) {
        const int4 a0 = ds[c], b0 = xs[c], a1 = ds[c + 32], b1 = xs[c + 32];
        dd[c] = a0; xd[c] = b0; dd[c + 32] = a1; xd[c + 32] = b1;
        wd[c] = scale_bf16x8(a0, w);
        wd[c + 32] = scale_bf16x8(a1, w);
    }
    for (; c < n; c += 32) {
        const int4 a = ds[c];
        dd[c] = a;
        xd[c] = xs[c];
        wd[c] = scale_bf16x8(a, w);
    }
}

/* One warp, a ring row of the FP8 backward (the pull's, or the combine_push's into a peer's ring):
 * bf16(x^) of the token's x^ codes and scales into x_out, its codes and scales also into the code
 * row xq_out when the tile replays (else NULL), bf16(w · dy) into dyw_out, dy^ into the code row
 * dyq_out: copied from the token's code row dyq (made once per token before the pass,
 * backward_fp8.cuh), or where that is NULL quantized here. PULL_FP8_BLOCKS 128-blocks a step,
 * every load of the step issued before the first store (the blocks' maxima are warp reductions,
 * so a step waits for its loads once): a lane's 16 codes of x in each quarter of the step's x
 * (block lane / 8 of four) and its 4 values of dy (and codes of dy^) in each block, as
 * fp8_quantize_blocks lays them. A row is latency-bound (a comm CTA's warps each hold one row's
 * step in flight, and a step waits for all its loads before its maxima), so the step is as wide
 * as the registers allow (docs/log.md: eight blocks against four). */
#define PULL_FP8_BLOCKS 8
static __device__ __forceinline__ void pull_row_fp8(uint16_t *x_out, uint8_t *xq_out, uint16_t *dyw_out,
                                                    uint8_t *dyq_out, const uint8_t *xq, const float *xs,
                                                    const uint16_t *dy, const uint8_t *dyq, float w, long long H) {
    static_assert(PULL_FP8_BLOCKS % 4 == 0, "x moves in quarters of four blocks: 16 codes a lane");
    constexpr int XQ = PULL_FP8_BLOCKS / 4;
    const int lane = threadIdx.x & 31;
    const long long nb = H / MOK_FP8_BLOCK;
    float *dy_scales = (float *)(dyq_out + H);
    for (long long b0 = 0; b0 < nb; b0 += PULL_FP8_BLOCKS) {
        uint2 d[PULL_FP8_BLOCKS];
        uint32_t dq[PULL_FP8_BLOCKS]; /* dy^'s codes, where they come made */
        uint4 codes[XQ];
        float s[XQ];
#pragma unroll
        for (int i = 0; i < PULL_FP8_BLOCKS; ++i) {
            const bool in = b0 + i < nb;
            d[i] = in ? *(const uint2 *)(dy + (b0 + i) * MOK_FP8_BLOCK + 4 * lane) : make_uint2(0u, 0u);
            dq[i] = in && dyq ? *(const uint32_t *)(dyq + (b0 + i) * MOK_FP8_BLOCK + 4 * lane) : 0u;
        }
#pragma unroll
        for (int j = 0; j < XQ; ++j) {
            const long long xb = b0 + 4 * j + lane / 8, at = (b0 + 4 * j) * MOK_FP8_BLOCK + 16 * lane;
            codes[j] = xb < nb ? *(const uint4 *)(xq + at) : make_uint4(0u, 0u, 0u, 0u);
            s[j] = xb < nb ? xs[xb] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < XQ; ++j) {
            const long long xb = b0 + 4 * j + lane / 8, at = (b0 + 4 * j) * MOK_FP8_BLOCK + 16 * lane;
            if (xb >= nb) continue;
            *(int4 *)(x_out + at) = bf16x8_from_e4m3x8(make_uint2(codes[j].x, codes[j].y), s[j]);
            *(int4 *)(x_out + at + 8) = bf16x8_from_e4m3x8(make_uint2(codes[j].z, codes[j].w), s[j]);
            if (xq_out) *(uint4 *)(xq_out + at) = codes[j];
        }
        float v[PULL_FP8_BLOCKS][4];
        int e[PULL_FP8_BLOCKS];
#pragma unroll
        for (int i = 0; i < PULL_FP8_BLOCKS; ++i) {
            v[i][0] = mok__bf16_to_f32((uint16_t)(d[i].x & 0xffffu));
            v[i][1] = mok__bf16_to_f32((uint16_t)(d[i].x >> 16));
            v[i][2] = mok__bf16_to_f32((uint16_t)(d[i].y & 0xffffu));
            v[i][3] = mok__bf16_to_f32((uint16_t)(d[i].y >> 16));
        }
        if (!dyq) { /* (uniform across the warp) */
#pragma unroll
            for (int i = 0; i < PULL_FP8_BLOCKS; ++i) {
                e[i] = fp8_warp_scale_exp(v[i]); /* every lane: warp reductions */
                dq[i] = fp8_codes4(v[i], e[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < PULL_FP8_BLOCKS; ++i) {
            if (b0 + i >= nb) continue;
            const long long col = (b0 + i) * MOK_FP8_BLOCK + 4 * lane;
            *(uint32_t *)(dyq_out + col) = dq[i];
            *(uint2 *)(dyw_out + col) =
                make_uint2(bf16x2_from_f32(w * v[i][0], w * v[i][1]), bf16x2_from_f32(w * v[i][2], w * v[i][3]));
            if (!dyq && lane == 0) dy_scales[b0 + i] = mok__fp8_pow2(e[i]);
        }
    }
    for (long long b = lane; b < nb; b += 32) {
        if (dyq) dy_scales[b] = ((const float *)(dyq + H))[b];
        if (xq_out) ((float *)(xq_out + H))[b] = xs[b];
    }
}

/* One warp: a ring row's dx part (h bf16) into its owner's (token, slot) row, and lane 0 the
 * row's d_router_w, the sum of its nI dh tiles' partial dot products in column order. Push and
 * gather both write through here, so the two directions give the same bits. */
static __device__ __forceinline__ void dx_row_out(uint16_t *dx_out, float *drw_out, const uint16_t *y,
                                                  const float *rdot, long long n_parts, long long h) {
    copy_row(dx_out, y, h);
    if ((threadIdx.x & 31) == 0) {
        float sum = 0.0f;
        for (long long j = 0; j < n_parts; ++j) sum += rdot[j];
        *drw_out = sum;
    }
}

/* One warp: a padding ring row's x and bf16(w * dy) as zeros (the weight gradients read them). */
static __device__ __forceinline__ void zero_pad_row(uint16_t *x_out, uint16_t *dyw_out, long long h) {
    int4 *x = (int4 *)x_out, *d = (int4 *)dyw_out;
    for (int c = threadIdx.x & 31; c < (int)(h / 8); c += 32) x[c] = d[c] = make_int4(0, 0, 0, 0);
}

#endif
