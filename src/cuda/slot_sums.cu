/* slot_sums.cu — the last stage of a pass, after its closing barrier: each token's fixed-order
 * sum over its k slots, y[t] = bf16(shared part + sum_j w[t,j] * expert output (t, j)) in the
 * forward, dx[t] = bf16(shared part + sum_j dx part (t, j)) and d_router_w in the backward, from
 * the per-(token, slot) rows the experts' owners wrote into this rank's window. One thread per 8
 * columns of a token; the order (shared, then j = 0..k-1, empty slots skipped) is the function's
 * rounding contract (mok.h). */
#include "cuda/megakernel/params.cuh"

/* Both passes' slot sums: the fixed-order sum of one token's 8-column chunk over its k slots, onto
 * acc (which holds the shared expert's part, or zeros): slot j = 0..k-1 in order, empty slots (id
 * < 0) skipped, each part times w[j] when WEIGHTED (the forward's y) or as it is (the backward's
 * dx). rows[j * ld] is slot j's chunk. Eight slots' ids, weights and rows are loaded before their
 * sums (an empty slot's row is in the buffer too, its bytes unused), so a thread keeps eight row
 * loads in flight instead of one; the sums, and so the bits, are those of the plain loop. */
template <bool WEIGHTED>
static __device__ __forceinline__ void slot_sum8(float (&acc)[8], const int32_t *ids, const float *w,
                                                 const uint16_t *rows, long long ld, int k) {
    for (int j0 = 0; j0 < k; j0 += 8) {
        int4 r[8];
        int32_t id[8];
        float wj[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            id[q] = -1;
            if (j0 + q < k) {
                id[q] = ids[j0 + q];
                wj[q] = WEIGHTED ? w[j0 + q] : 1.0f;
                r[q] = *(const int4 *)(rows + (long long)(j0 + q) * ld);
            }
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            if (id[q] < 0) continue;
            const uint16_t *in = (const uint16_t *)&r[q];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (WEIGHTED) acc[i] += wj[q] * mok__bf16_to_f32(in[i]);
                else acc[i] += mok__bf16_to_f32(in[i]);
            }
        }
    }
}

/* y[t] = bf16(shared[t] + sum_j w[t,j] * comb[t,j]) in fp32, in that order; one thread per 8
 * columns of a token. */
__global__ void forward_slot_sums_kernel(const pass_params p, const float *router_w, uint16_t *y, const char *comb_base) {
    if (*(volatile const int *)p.error) return; /* the pass failed or was refused: its schedule may not be one */
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    const long long chunks = p.hidden / 8;
    const uint16_t *comb = (const uint16_t *)comb_base;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < p.num_tokens * chunks;
         idx += (long long)gridDim.x * blockDim.x) {
        long long t = idx / chunks, c8 = (idx % chunks) * 8;
        float acc[8];
        uint16_t in[8];
        if (p.shared_inter > 0) {
            *(int4 *)in = *(const int4 *)(p.sh_out + t * p.hidden + c8);
            for (int i = 0; i < 8; ++i) acc[i] = mok__bf16_to_f32(in[i]);
        } else {
            for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
        }
        slot_sum8<true>(acc, v.own_ids + t * p.topk, router_w + t * p.topk, comb + t * p.topk * p.hidden + c8, p.hidden,
                        p.topk);
        *(int4 *)(y + t * p.hidden + c8) = bf16x8_from_f32(acc);
    }
}

/* dx[t] = bf16(shared part + sum_j routed parts) in fp32, in that order; d_router_w from the
 * experts' owners (0 for empty slots). One thread per 8 columns of a token. */
__global__ void backward_slot_sums_kernel(const pass_params p, uint16_t *dx, float *d_router_w, const char *sym,
                                         size_t off_dxbuf, size_t off_drw) {
    if (*(volatile const int *)p.error) return; /* the pass failed or was refused: its schedule may not be one */
    mok_sched_view v = mok__sched_view(&p.layout, (void *)p.schedule);
    const long long chunks = p.hidden / 8;
    const uint16_t *dxbuf = (const uint16_t *)(sym + off_dxbuf);
    const float *drw = (const float *)(sym + off_drw);
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < p.num_tokens * chunks;
         idx += (long long)gridDim.x * blockDim.x) {
        long long t = idx / chunks, c8 = (idx % chunks) * 8;
        float acc[8];
        uint16_t in[8];
        if (p.shared_inter > 0) {
            *(int4 *)in = *(const int4 *)(p.sh_out + t * p.hidden + c8);
            for (int i = 0; i < 8; ++i) acc[i] = mok__bf16_to_f32(in[i]);
        } else {
            for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
        }
        if (c8 == 0)
            for (int j = 0; j < p.topk; ++j)
                d_router_w[t * p.topk + j] = v.own_ids[t * p.topk + j] >= 0 ? drw[t * p.topk + j] : 0.0f;
        slot_sum8<false>(acc, v.own_ids + t * p.topk, nullptr, dxbuf + t * p.topk * p.hidden + c8, p.hidden, p.topk);
        *(int4 *)(dx + t * p.hidden + c8) = bf16x8_from_f32(acc);
    }
}

mok_status mok__cuda_forward_slot_sums(const pass_params &p, int num_sms, const float *router_w, uint16_t *y,
                                       const char *comb, cudaStream_t stream) {
    LAUNCH_TRY(forward_slot_sums_kernel<<<num_sms * 4, 256, 0, stream>>>(p, router_w, y, comb));
    return MOK_OK;
}

mok_status mok__cuda_backward_slot_sums(const pass_params &p, int num_sms, uint16_t *dx, float *d_router_w,
                                        const char *sym, size_t off_dxbuf, size_t off_drw, cudaStream_t stream) {
    LAUNCH_TRY(backward_slot_sums_kernel<<<num_sms * 4, 256, 0, stream>>>(p, dx, d_router_w, sym, off_dxbuf, off_drw));
    return MOK_OK;
}
