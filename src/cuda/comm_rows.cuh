/* comm_rows.cuh — how a comm CTA moves the rows of one task (dispatch, combine, pull, push):
 * one thread streams the source rows into shared-memory slots with bulk copies (the TMA's 1-D
 * form, up to ~180 KB in flight per SM), and the other warps store each row from its slot to
 * its destination with 16-byte stores (optionally also bf16(w * row), the pull's w·dy). A warp
 * copying straight from global memory keeps only 2 KB in flight and moves ~25 GB/s per SM; the
 * slots lift that bound by the ratio of bytes in flight.
 *
 * A task first fills the item tables (src, dst, dst_w, w) for its n items, all threads at once,
 * then calls cr_move. Without bulk copies (rows not 16-byte multiples, a row larger than the
 * slots allow, MOK_CUDA_TMA=0 or MOK_CUDA_BULK=0) the same tables are walked by warps copying
 * global to global.
 *
 * NOTE (slot ring): CR_WARPS - 1 consumer warps (warps 1..), each with `per_warp` private slots.
 * Item g (the CTA's running item count `seq` plus the item's index in the task; the same on
 * every thread, since all threads see the same tasks) belongs to consumer c = g % consumers, its
 * m = g / consumers-th item; it uses slot c * per_warp + m % per_warp for the u = m / per_warp-th
 * time. full[slot] (count 1) is armed by the loading thread with the row's bytes and completes
 * when they land; empty[slot] (count 1) gets lane 0 of the consumer after its warp has read the
 * slot. Uses of a slot are consumed by one warp in order, so every wait is at most one phase
 * ahead: the consumer waits full with parity u & 1, the loader waits empty with parity
 * (u & 1) ^ 1 (a fresh barrier passes at once).
 *
 * NOTE (memory order): sources were written by other CTAs (generic stores, released through the
 * pass's counters and acquired by thread 0, the loader) or before the kernel; the loader fences
 * the generic and async proxies after that acquire and before its first bulk load. Slot reads
 * complete before the empty arrive, and every bulk load is consumed before cr_move returns, so
 * no copy is in flight when the task ends. The stores are generic: the task's closing
 * bar.sync, __threadfence and counter release order them for the readers, as for any task.
 * Waits are bounded like every wait of the pass (wgmma_tile.cuh: NOTE on faults). */
#ifndef MOK_CUDA_COMM_ROWS_CUH
#define MOK_CUDA_COMM_ROWS_CUH

#include "pass.cuh"
#include "wgmma_tile.cuh"

#define CR_ITEMS (2 * MOK_ROW_TILE) /* a pull moves two rows (x, dy) per ring row */
#define CR_TABLE_BYTES (CR_ITEMS * 28)
#define CR_MAX_PER_WARP 8
#define CR_WARPS (WS_THREADS / 32)
#define CR_CONSUMERS (CR_WARPS - 1)
#define CR_BAR_OFF CR_TABLE_BYTES
#define CR_SLOTS_OFF ((CR_BAR_OFF + 16 * CR_CONSUMERS * CR_MAX_PER_WARP + 1023) / 1024 * 1024)

struct comm_ring {
    const int4 **src;      /* [CR_ITEMS] tables in shared memory */
    int4 **dst;
    int4 **dst_w;          /* also bf16(w * row) here, or NULL */
    float *w;
    uint8_t *slot;         /* slot 0 (generic address) */
    uint32_t slot_s, full, empty; /* shared addresses: slot 0, the barrier arrays */
    uint32_t row_bytes, slot_bytes;
    int per_warp;          /* 0: no bulk copies, warps copy global to global */
    long long seq;
};

static __device__ __forceinline__ void bulk_load(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
static __device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* All threads: the ring in the CTA's dynamic shared memory (smem_bytes from a 1024-aligned base). */
static __device__ void cr_init(comm_ring &cr, uint8_t *base, uint32_t smem_bytes, const pass_params &p) {
    cr.src = (const int4 **)base;
    cr.dst = (int4 **)(base + CR_ITEMS * 8);
    cr.dst_w = (int4 **)(base + CR_ITEMS * 16);
    cr.w = (float *)(base + CR_ITEMS * 24);
    cr.slot = base + CR_SLOTS_OFF;
    cr.slot_s = (uint32_t)__cvta_generic_to_shared(cr.slot);
    cr.full = (uint32_t)__cvta_generic_to_shared(base + CR_BAR_OFF);
    cr.empty = cr.full + 8 * CR_CONSUMERS * CR_MAX_PER_WARP;
    cr.row_bytes = (uint32_t)(p.hidden * 2);
    cr.slot_bytes = (cr.row_bytes + 127) / 128 * 128;
    int per = (int)((smem_bytes - CR_SLOTS_OFF) / (cr.slot_bytes * CR_CONSUMERS));
    cr.per_warp = p.bulk_rows && cr.row_bytes % 16 == 0 ? (per < CR_MAX_PER_WARP ? per : CR_MAX_PER_WARP) : 0;
    cr.seq = 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < CR_CONSUMERS * CR_MAX_PER_WARP; ++s) {
            mbar_init(cr.full + 8 * s, 1);
            mbar_init(cr.empty + 8 * s, 1);
        }
        mbar_init_fence();
    }
    __syncthreads();
}

/* One item, by a whole warp: the row at `from` to dst (and bf16(w * row) to dst_w). */
static __device__ __forceinline__ void cr_store(const int4 *from, int4 *dst, int4 *dst_w, float w, int n16) {
    const int lane = threadIdx.x & 31;
    if (!dst_w) {
        int c = lane;
        for (; c + 96 < n16; c += 128) {
            int4 v0 = from[c], v1 = from[c + 32], v2 = from[c + 64], v3 = from[c + 96];
            dst[c] = v0; dst[c + 32] = v1; dst[c + 64] = v2; dst[c + 96] = v3;
        }
        for (; c < n16; c += 32) dst[c] = from[c];
        return;
    }
    for (int c = lane; c < n16; c += 32) {
        const int4 a = from[c];
        dst[c] = a;
        uint16_t e[8], f[8];
        *(int4 *)e = a;
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = mok__bf16_from_f32(w * mok__bf16_to_f32(e[i]));
        dst_w[c] = *(int4 *)f;
    }
}

/* All threads, after the tables of items [0, n) are filled and the CTA synchronised: moves them. */
static __device__ void cr_move(comm_ring &cr, const pass_params &p, int n) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n16 = (int)(cr.row_bytes / 16);
    if (cr.per_warp == 0) {
        for (int j = warp; j < n; j += CR_WARPS) cr_store(cr.src[j], cr.dst[j], cr.dst_w[j], cr.w[j], n16);
        return;
    }
    unsigned long long *abort = p.counters + p.counters_cap + 2;
    const int per = cr.per_warp;
    if (warp == 0) {
        if (lane == 0) {
            fence_proxy_async_global();
            for (int j = 0; j < n; ++j) {
                const long long g = cr.seq + j, m = g / CR_CONSUMERS;
                const int s = (int)(g % CR_CONSUMERS) * per + (int)(m % per);
                const uint32_t u = (uint32_t)(m / per);
                mbar_wait(cr.empty + 8 * s, (u & 1) ^ 1, abort, p.error, p.timeout_ns);
                mbar_arrive_expect_tx(cr.full + 8 * s, cr.row_bytes);
                bulk_load(cr.slot_s + s * cr.slot_bytes, cr.src[j], cr.row_bytes, cr.full + 8 * s);
            }
        }
    } else {
        const int c = warp - 1;
        /* this warp's items: g = seq + j with g % CR_CONSUMERS == c */
        long long j = ((c - cr.seq) % CR_CONSUMERS + CR_CONSUMERS) % CR_CONSUMERS;
        for (; j < n; j += CR_CONSUMERS) {
            const long long m = (cr.seq + j) / CR_CONSUMERS;
            const int s = c * per + (int)(m % per);
            const uint32_t u = (uint32_t)(m / per);
            mbar_wait(cr.full + 8 * s, u & 1, abort, p.error, p.timeout_ns);
            cr_store((const int4 *)(cr.slot + s * cr.slot_bytes), cr.dst[j], cr.dst_w[j], cr.w[j], n16);
            __syncwarp();
            if (lane == 0) mbar_arrive(cr.empty + 8 * s);
        }
    }
    cr.seq += n;
}

#endif
