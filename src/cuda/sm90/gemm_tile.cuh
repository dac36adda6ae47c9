/* gemm_tile.cuh — the warpgroup GEMM tile of the cuda backend (sm_90a): a ring of shared-memory
 * stages that a producer warpgroup fills with cp.async and two consumer warpgroups read with
 * wgmma. C[128 x 256] (+)= A[128 x K] · B[K x 256] in fp32, on the operands of tile_operands.cuh
 * (tile_operands.cuh: K-major or M/N-major, rows past a_rows, n_valid and k_valid read as zeros).
 *
 * Stage s: A at stages + s * STAGE_BYTES (16 KB: two 8 KB blocks), B the 32 KB after it (four
 * 8 KB blocks). A block is 64 rows of 128 bytes in the 128B swizzle (16-byte chunk ^ row % 8),
 * 1024-byte aligned: the canonical layouts that wgmma's shared-memory descriptors name.
 *   K-major:  64 rows (m or n) of 64 k per block, blocks back to back: 8-row groups 1024 B
 *             apart (SBO) across the whole operand; +16 k = +32 B.
 *   MN-major: 64 k rows of 64 m (or n) per block; 8-k groups 1024 B apart (SBO), the next
 *             64-wide block 8 KB further (LBO); +16 k = +2048 B. wgmma reads it with imm-trans = 1.
 * Consumer warpgroup c owns rows 64c .. 64c + 63 of C, i.e. A's block c, and all 256 columns
 * (m64n256: 128 fp32 accumulators per thread).
 *
 * NOTE (ring protocol): full[s] counts the pass's loader threads (LOADER_THREADS, or warp 0 alone
 * where warps 1-2 take epilogue parts instead: compute_walk.cuh, NOTE (handoff)), each arriving through
 * cp.async.mbarrier.arrive.noinc once its copies into stage s have landed; empty[s] counts the 8
 * consumer warps, each arriving (lane 0) once wgmma.wait_group shows the wgmmas that read stage
 * s complete. Both sides walk the stages in one order, the phase bit flipping at each wrap; the
 * producer waits on empty with the opposite parity (a fresh barrier passes at once). cp.async
 * writes are generic-proxy writes and wgmma reads through the async proxy, so consumers fence
 * the proxies after each full wait. A TMA stage (tma.cuh) keeps the count: thread 0 arms the
 * barrier with the byte count, the other loaders arrive plainly, or (FP8) through
 * cp.async.mbarrier.arrive.noinc once their copies of the stage's scales have landed.
 *
 * NOTE (faults): every mbarrier wait is bounded (mbar_wait), but for mbar_wait_idle's, which the
 * threads that complete its phase end by their own bounded waits. A wait that outlives the pass's
 * timeout sets MOK_KERR_STALL and the abort flag; once the flag is up every wait returns at once,
 * so all threads keep one instruction stream (wgmma is warpgroup-collective) and the kernel ends. */
#ifndef MOK_CUDA_WGMMA_TILE_CUH
#define MOK_CUDA_WGMMA_TILE_CUH

#include "cuda/sm90/ptx.cuh"
#include "cuda/sm90/tile_operands.cuh"
#include "cuda/sm90/tma.cuh"

#define RING_STAGES 3 /* 48 KB each: 144 KB of ring beside the 34 KB staging tile */
#define SWIZZLE_BLOCK_BYTES (64 * 128)
#define STAGE_A_BYTES (TILE_BM * TILE_BK * 2)
#define STAGE_BYTES (STAGE_A_BYTES + TILE_BN * TILE_BK * 2)
#define STAGE_B_BLOCKS (TILE_BN / 64)
#define PRODUCER_THREADS 128 /* the producer warpgroup: warps 0-2 load (LOADER_THREADS), warp 3 completes tasks */
#define LOADER_THREADS 96
#define CONSUMER_THREADS 256
#define COMPUTE_THREADS (PRODUCER_THREADS + CONSUMER_THREADS)
#define TILE_ACC WGMMA_N256_ACC /* fp32 accumulators per consumer thread: m64n256 */
/* Registers per thread after the role split (setmaxnreg): the CTA holds what its launch gave it,
   168 x 384 = 64,512 (launch bounds 384, 1), and the roles share at most that: 128 * 80 +
   256 * 208 = 63,488. More would leave setmaxnreg.inc waiting for registers no warp releases.
   The consumers hold 128 accumulators; the producer addresses, counters and the schedule's
   cursor. With fewer registers the producer spills more, right after its counter acquires,
   which invalidate L1, so a reload may go to L2; the consumers' share keeps their wgmma loop
   free of spills. (The FP8 kernels split them otherwise: fp8_tile.cuh.) */
#define PRODUCER_REGS 80
#define CONSUMER_REGS 208


/* Named barriers: 1 for the consumer warpgroups, 2 for the producer warpgroup's loading warps (a
   multiple of 32 threads). */
static __device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMER_THREADS) : "memory"); }
static __device__ __forceinline__ void producer_sync(int loaders) { asm volatile("bar.sync 2, %0;" ::"r"(loaders) : "memory"); }

/* Waits for the phase of `bar` with this parity, bounded (see the NOTE on faults). */
static __device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, unsigned long long *abort, int *error,
                                                 long long timeout_ns) {
    if (mbar_try_wait(bar, parity)) return;
    long long start = globaltimer_ns();
    for (unsigned spins = 1;; ++spins) {
        if (mbar_try_wait(bar, parity)) return;
        if ((spins & 255) == 0) {
            if (*(volatile unsigned long long *)abort) return;
            if (globaltimer_ns() - start > timeout_ns) {
                set_error(error, MOK_KERR_STALL);
                atomicExch(abort, 1ull);
                return;
            }
        }
    }
}

/* Waits for the phase of `bar` with this parity until it completes or the abort flag is up, with
 * no timeout of its own: for a wait that spans the CTA's own work (compute_walk.cuh, NOTE
 * (handoff)), which is no hang however long, and which the threads that complete the phase end
 * (they end on their own bounded waits, raising the flag if one times out). */
static __device__ __forceinline__ void mbar_wait_idle(uint32_t bar, uint32_t parity, unsigned long long *abort) {
    for (unsigned spins = 1;; ++spins) {
        if (mbar_try_wait(bar, parity)) return;
        if ((spins & 255) == 0 && *(volatile unsigned long long *)abort) return;
    }
}

static __device__ __forceinline__ void setmaxnreg_dec_producer() { setmaxnreg_dec<PRODUCER_REGS>(); }
static __device__ __forceinline__ void setmaxnreg_inc_consumer() { setmaxnreg_inc<CONSUMER_REGS>(); }

/* ---- the ring ----------------------------------------------------------------------------- */
struct stage_ring {
    uint32_t stages; /* shared address of stage 0, 1024-byte aligned */
    uint32_t full, empty; /* RING_STAGES mbarriers each */
    int stage;
    uint32_t phase;
    unsigned long long *abort;
    int *error;
    long long timeout_ns;
    const CUtensorMap *maps; /* the pass's tensor maps (parameter space), or NULL */
    uint32_t scales; /* FP8: shared address of stage 0's scale slot (STAGE_SCALE_BYTES each) */
};

static __device__ __forceinline__ void ring_advance(stage_ring &r) {
    if (++r.stage == RING_STAGES) {
        r.stage = 0;
        r.phase ^= 1;
    }
}

static __device__ __forceinline__ int k_steps(const tile_operands &op) { return (int)((op.k + TILE_BK - 1) / TILE_BK); }

/* FP8: each stage carries its K block's scales beside its codes, a slot of STAGE_SCALES floats:
 * A's row scales (row m at m, 0 for rows past a_rows), then B's per 128-column chunk c (at
 * TILE_BM + c, 0 for a chunk past n_valid). Loader threads 1.. copy them with cp.async, which
 * their arrival on full[s] waits for (thread 0 arms the TMA barrier), so the consumers read
 * them from shared memory after the full wait: no global load, and none of the operands'
 * pointers, on their loop's path. */
#define STAGE_SCALES (TILE_BM + TILE_BN / 128 + 2)
#define STAGE_SCALE_BYTES (STAGE_SCALES * 4)
#define SCALE_LOADERS (LOADER_THREADS - 1)
static_assert(2 * SCALE_LOADERS >= TILE_BM + TILE_BN / 128, "two scales per loader thread fill a slot");

template <bool FP8>
static __device__ __forceinline__ void load_scales(const stage_ring &r, const tile_operands &op, int kb, int tid) {
    if (!FP8 || tid == 0) return;
    const uint32_t slot = r.scales + r.stage * STAGE_SCALE_BYTES;
    const int ks = (int)(op.bk_split / TILE_BK);
    const bool after = op.bk_split > 0 && kb >= ks; /* B's K blocks past its K split */
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int idx = tid - 1 + i * SCALE_LOADERS;
        const float *src = nullptr;
        if (idx < TILE_BM) {
            if (idx < op.a_rows) src = op.sa + idx * op.sa_ld + kb;
        } else if (idx < TILE_BM + TILE_BN / 128) { /* (selects, not an index: op stays in registers) */
            const bool c0 = idx == TILE_BM;
            const float *b = after ? (c0 ? op.sb2[0] : op.sb2[1]) : (c0 ? op.sb[0] : op.sb[1]);
            if (b) src = b + (after ? kb - ks : kb);
        } else {
            break;
        }
        cp_async_4(slot + idx * 4, src ? src : op.sa, src != nullptr);
    }
}

/* Producer, one stage: the LOADER_THREADS threads (tid) copy A and B's 64-k slice at k0 (tile_operands.cuh's
 * layout): 1024 16-byte chunks of A, 2048 of B. KSPLIT: K-major B may have a K split (bk_split,
 * the FP8 kernels only; the bf16 ones compile without it). */
#define LOAD_ITERS_A ((1024 + LOADER_THREADS - 1) / LOADER_THREADS)
#define LOAD_ITERS_B ((64 * TILE_BN / 8 + LOADER_THREADS - 1) / LOADER_THREADS)
template <bool A_MN, bool B_MN, bool KSPLIT = false>
static __device__ __forceinline__ void load_stage(uint32_t a_base, const tile_operands &op, long long k0, int tid) {
    const uint32_t b_base = a_base + STAGE_A_BYTES;
    if (A_MN) {
#pragma unroll 2
        for (int i = 0; i < LOAD_ITERS_A; ++i) {
            int idx = tid + i * LOADER_THREADS;
            if (idx >= 1024) break;
            int krow = idx >> 4, c = idx & 15, half = c >> 3, chunk = c & 7;
            long long k = k0 + krow;
            bool valid = k < op.k_valid && half * 64 < op.a_rows;
            const uint16_t *src = valid ? op.a + k * op.lda + half * 64 + chunk * 8 : op.a;
            cp_async_16(a_base + half * SWIZZLE_BLOCK_BYTES + swizzle(krow, chunk), src, valid);
        }
    } else {
#pragma unroll 2
        for (int i = 0; i < LOAD_ITERS_A; ++i) {
            int idx = tid + i * LOADER_THREADS;
            if (idx >= 1024) break;
            int row = idx >> 3, chunk = idx & 7;
            bool valid = row < op.a_rows;
            const uint16_t *src = op.a + (valid ? row * op.lda : 0) + k0 + chunk * 8;
            cp_async_16(a_base + swizzle(row, chunk), src, valid);
        }
    }
    constexpr int B_CHUNKS = 64 * TILE_BN / 8;
    if (B_MN) { /* 64 k rows of STAGE_B_BLOCKS x 8 chunks */
#pragma unroll 2
        for (int i = 0; i < LOAD_ITERS_B; ++i) {
            int idx = tid + i * LOADER_THREADS;
            if (idx >= B_CHUNKS) break;
            int krow = idx / (8 * STAGE_B_BLOCKS), c = idx % (8 * STAGE_B_BLOCKS), block = c >> 3, chunk = c & 7;
            long long k = k0 + krow;
            bool valid = k < op.k_valid && block * 64 < op.n_valid;
            const uint16_t *src = op.b_lo;
            if (valid) src = (k < op.k_split ? op.b_lo + k * op.ldb : op.b_hi + (k - op.k_split) * op.ldb) + block * 64 + chunk * 8;
            cp_async_16(b_base + block * SWIZZLE_BLOCK_BYTES + swizzle(krow, chunk), src, valid);
        }
    } else { /* TILE_BN rows of 8 chunks */
        const bool ks = KSPLIT && op.bk_split > 0 && k0 >= op.bk_split; /* past the K split: all of B from b_hi */
        const long long kb = ks ? k0 - op.bk_split : k0;
#pragma unroll 2
        for (int i = 0; i < LOAD_ITERS_B; ++i) {
            int idx = tid + i * LOADER_THREADS;
            if (idx >= B_CHUNKS) break;
            int row = idx >> 3, chunk = idx & 7;
            const bool lo = !ks && row < 64 * op.b_split;
            const uint16_t *base = lo ? op.b_lo : op.b_hi;
            const long long r = lo || ks ? row : row - 64 * op.b_split;
            bool valid = base != nullptr && row < op.n_valid;
            const uint16_t *src = valid ? base + r * op.ldb + kb + chunk * 8 : op.b_lo;
            cp_async_16(b_base + swizzle(row, chunk), src, valid);
        }
    }
}

/* Producer: every stage of one GEMM, in ring order. FP8: its operands are E4M3 (tile_operands.cuh),
 * K-major B may have a K split, and each stage carries its scales. */
template <bool A_MN, bool B_MN, bool FP8 = false>
static __device__ void produce_gemm(stage_ring &r, const tile_operands &op, int tid) {
    const int ktiles = k_steps(op);
    for (int kt = 0; kt < ktiles; ++kt) {
        mbar_wait(r.empty + 8 * r.stage, r.phase ^ 1, r.abort, r.error, r.timeout_ns);
        load_stage<A_MN, B_MN, FP8>(r.stages + r.stage * STAGE_BYTES, op, (long long)kt * TILE_BK, tid);
        load_scales<FP8>(r, op, kt, tid);
        cp_async_arrive(r.full + 8 * r.stage);
        ring_advance(r);
    }
}

/* Producer, TMA: thread 0 arms full[s] with the stage's byte count and issues the boxes; the
 * other loaders arrive plainly (FP8: once their scale copies have landed), so full[s] keeps its
 * count of LOADER_THREADS on both paths. */
template <bool FP8 = false>
static __device__ void produce_tma(stage_ring &r, const tile_operands &op, int tid) {
    const int ktiles = k_steps(op);
    const uint32_t bytes = (op.a_halves + op.b_halves) * SWIZZLE_BLOCK_BYTES;
    for (int kt = 0; kt < ktiles; ++kt) {
        mbar_wait(r.empty + 8 * r.stage, r.phase ^ 1, r.abort, r.error, r.timeout_ns);
        const uint32_t a = r.stages + r.stage * STAGE_BYTES, full = r.full + 8 * r.stage;
        if (tid == 0) {
            const int k0 = kt * TILE_BK;
            mbar_arrive_expect_tx(full, bytes);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (h >= op.a_halves) break;
                if (!op.a_mmajor) tma_load_2d(a + h * SWIZZLE_BLOCK_BYTES, r.maps + op.a_map, k0, op.a_row + 64 * h, full);
                else tma_load_2d(a + h * SWIZZLE_BLOCK_BYTES, r.maps + op.a_map, op.a_col + 64 * h, op.a_row + k0, full);
            }
            /* (the arrays are indexed by constants or selects only: no local memory) */
            const bool second = k0 >= op.k_split;
            const int map_n = second ? op.b_map[1] : op.b_map[0];
            const int krow = second ? op.b_row[1] + k0 - (int)op.k_split : op.b_row[0] + k0;
            const bool ks = FP8 && op.bk_split > 0 && k0 >= op.bk_split; /* K-major B past its K split */
#pragma unroll
            for (int h = 0; h < STAGE_B_BLOCKS; ++h) {
                if (h >= op.b_halves) break;
                const uint32_t dst = a + STAGE_A_BYTES + h * SWIZZLE_BLOCK_BYTES;
                const bool lo = !ks && h < op.b_split;
                if (!op.b_nmajor)
                    tma_load_2d(dst, r.maps + (lo ? op.b_map[0] : op.b_map[1]), ks ? k0 - (int)op.bk_split : k0,
                                lo ? op.b_row[0] + 64 * h : op.b_row[1] + 64 * (ks ? h : h - op.b_split), full);
                else tma_load_2d(dst, r.maps + map_n, op.b_col + 64 * h, krow, full);
            }
        } else if (FP8) {
            load_scales<FP8>(r, op, kt, tid);
            cp_async_arrive(full);
        } else {
            mbar_arrive(full);
        }
        ring_advance(r);
    }
}

/* Consumer: acc += the GEMM's product over its stages (acc holds the starting values).
 * NOTE: the accumulators must be written on every path before this (the runner's preset does
 * it): an accumulator that may still hold the previous GEMM's wgmma result, or a write in a
 * branch here, makes ptxas wait on every wgmma group before the next (C7514/C7517). */
template <bool A_MN, bool B_MN>
static __device__ __forceinline__ void consume_gemm(stage_ring &r, const tile_operands &op, float (&acc)[TILE_ACC]) {
    const int ktiles = k_steps(op), consumer = (threadIdx.x >> 7) - 1, lane = threadIdx.x & 31;
    if (ktiles == 0) return;

    const uint32_t a_lbo = A_MN ? SWIZZLE_BLOCK_BYTES : 16, b_lbo = B_MN ? SWIZZLE_BLOCK_BYTES : 16;
    const uint32_t k16 = A_MN ? 2048 : 32, k16b = B_MN ? 2048 : 32;
    int prev = 0;
    for (int kt = 0; kt < ktiles; ++kt) {
        mbar_wait(r.full + 8 * r.stage, r.phase, r.abort, r.error, r.timeout_ns);
        __syncwarp();
        if (!op.tma) fence_proxy_async(); /* TMA writes through the async proxy already */
        const uint32_t a = r.stages + r.stage * STAGE_BYTES, b = a + STAGE_A_BYTES;
        const uint32_t a_half = a + consumer * SWIZZLE_BLOCK_BYTES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < TILE_BK / 16; ++k)
            wgmma_m64n256k16<A_MN ? 1 : 0, B_MN ? 1 : 0>(acc, smem_desc(a_half + k * k16, a_lbo),
                                                         smem_desc(b + k * k16b, b_lbo), 1);
        wgmma_commit();
        wgmma_wait<1>();
        if (kt > 0 && lane == 0) mbar_arrive(r.empty + 8 * prev);
        prev = r.stage;
        ring_advance(r);
    }
    wgmma_wait<0>();
    pin_acc(acc);
    if (lane == 0) mbar_arrive(r.empty + 8 * prev);
}

/* Position of accumulator register i of this consumer thread in the 128 x 256 tile. */
static __device__ __forceinline__ void acc_position(int i, int *row, int *col) {
    const int t = threadIdx.x - PRODUCER_THREADS, lane = t & 31;
    *row = (t >> 5) * 16 + (lane >> 2) + ((i & 2) ? 8 : 0);
    *col = (i >> 2) * 8 + 2 * (lane & 3) + (i & 1);
}

#endif
