/* wgmma_tile.cuh — the warpgroup GEMM tile of the cuda backend (sm_90a): a ring of shared-memory
 * stages that a producer warpgroup fills with cp.async and two consumer warpgroups read with
 * wgmma. C[128 x 256] (+)= A[128 x K] · B[K x 256] in fp32, on the operands of tile_operands.cuh
 * (tile_operands.cuh: K-major or M/N-major, rows past a_rows, n_valid and k_valid read as zeros).
 *
 * Stage s: A at stages + s * WS_STAGE_BYTES (16 KB: two 8 KB blocks), B the 32 KB after it (four
 * 8 KB blocks). A block is 64 rows of 128 bytes in the 128B swizzle (16-byte chunk ^ row % 8),
 * 1024-byte aligned: the canonical layouts that wgmma's shared-memory descriptors name.
 *   K-major:  64 rows (m or n) of 64 k per block, blocks back to back: 8-row groups 1024 B
 *             apart (SBO) across the whole operand; +16 k = +32 B.
 *   MN-major: 64 k rows of 64 m (or n) per block; 8-k groups 1024 B apart (SBO), the next
 *             64-wide block 8 KB further (LBO); +16 k = +2048 B. wgmma reads it with imm-trans = 1.
 * Consumer warpgroup c owns rows 64c .. 64c + 63 of C, i.e. A's block c, and all 256 columns
 * (m64n256: 128 fp32 accumulators per thread).
 *
 * NOTE (ring protocol): full[s] counts the WS_LOADERS producer threads, each arriving through
 * cp.async.mbarrier.arrive.noinc once its copies into stage s have landed; empty[s] counts the 8
 * consumer warps, each arriving (lane 0) once wgmma.wait_group shows the wgmmas that read stage
 * s complete. Both sides walk the stages in one order, the phase bit flipping at each wrap; the
 * producer waits on empty with the opposite parity (a fresh barrier passes at once). cp.async
 * writes are generic-proxy writes and wgmma reads through the async proxy, so consumers fence
 * the proxies after each full wait. A TMA stage (tma.cuh) keeps the count: thread 0 arms the
 * barrier with the byte count, the other loaders arrive plainly.
 *
 * NOTE (faults): every mbarrier wait is bounded. A wait that outlives the pass's timeout sets
 * MOK_KERR_STALL and the abort flag; once the flag is up every wait returns at once, so all
 * threads keep one instruction stream (wgmma is warpgroup-collective) and the kernel ends. */
#ifndef MOK_CUDA_WGMMA_TILE_CUH
#define MOK_CUDA_WGMMA_TILE_CUH

#include "tile_operands.cuh"
#include "tma.cuh"

#define WS_STAGES 3 /* 48 KB each: 144 KB of ring beside the 34 KB staging tile */
#define WS_HALF_BYTES (64 * 128)
#define WS_A_BYTES (TILE_BM * TILE_BK * 2)
#define WS_STAGE_BYTES (WS_A_BYTES + TILE_BN * TILE_BK * 2)
#define WS_B_BLOCKS (TILE_BN / 64)
#define WS_PRODUCERS 128 /* the producer warpgroup: warps 0-2 load (WS_LOADERS), warp 3 completes tasks */
#define WS_LOADERS 96
#define WS_CONSUMERS 256
#define WS_THREADS (WS_PRODUCERS + WS_CONSUMERS)
#define WS_ACC 128 /* fp32 accumulators per consumer thread: m64n256 */
/* Registers per thread after the role split (setmaxnreg): the CTA holds what its launch gave it,
   168 x 384 = 64,512 (launch bounds 384, 1), and the roles share at most that: 128 * 80 +
   256 * 208 = 63,488. More would leave setmaxnreg.inc waiting for registers no warp releases.
   The consumers hold 128 accumulators; the producer addresses, counters and the schedule's
   cursor. At 72 / 216 the producer spilled (forward 216 / 236 bytes, backward 372 / 544) right
   after its counter acquires, which invalidate L1, so a reload could go to L2; at 80 / 208:
   forward 136 / 136, backward 324 / 456, and no spill in the wgmma loop either way. */
#define WS_PRODUCER_REGS 80
#define WS_CONSUMER_REGS 208


/* ---- mbarrier and proxy primitives ---------------------------------------------------------- */
static __device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
/* Arrives on `bar` when every cp.async this thread issued so far has landed. */
static __device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
static __device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
/* Named barriers: 1 for the consumer warpgroups, 2 for the producer warpgroup's loading warps. */
static __device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(WS_CONSUMERS) : "memory"); }
static __device__ __forceinline__ void producer_sync() { asm volatile("bar.sync 2, %0;" ::"n"(WS_LOADERS) : "memory"); }

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

/* ---- wgmma -------------------------------------------------------------------------------- */
static __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/* Keeps the compiler from moving accumulator accesses across the asynchronous region. */
static __device__ __forceinline__ void pin_acc(float (&acc)[WS_ACC]) {
#pragma unroll
    for (int i = 0; i < WS_ACC; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

/* Descriptor of a 128B-swizzled operand half at `addr` (1024-byte aligned atoms, base offset 0). */
static __device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}

/* D[64 x 256] (+)= A[64 x 16] · B[16 x 256], both from shared memory. */
template <int TA, int TB>
static __device__ __forceinline__ void wgmma_m64n256k16(float (&d)[WS_ACC], uint64_t da, uint64_t db, int scale_d) {
#define ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                "+f"(d[i + 6]), "+f"(d[i + 7])
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, %131, %132;\n}\n"
        : ACC8(0), ACC8(8), ACC8(16), ACC8(24), ACC8(32), ACC8(40), ACC8(48), ACC8(56), ACC8(64), ACC8(72),
          ACC8(80), ACC8(88), ACC8(96), ACC8(104), ACC8(112), ACC8(120)
        : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB)
        : "memory");
#undef ACC8
}

static __device__ __forceinline__ void setmaxnreg_dec_producer() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(WS_PRODUCER_REGS));
}
static __device__ __forceinline__ void setmaxnreg_inc_consumer() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(WS_CONSUMER_REGS));
}

/* ---- the ring ----------------------------------------------------------------------------- */
struct ws_ring {
    uint32_t stages; /* shared address of stage 0, 1024-byte aligned */
    uint32_t full, empty; /* WS_STAGES mbarriers each */
    int stage;
    uint32_t phase;
    unsigned long long *abort;
    int *error;
    long long timeout_ns;
    const CUtensorMap *maps; /* the pass's tensor maps (parameter space), or NULL */
};

static __device__ __forceinline__ void ring_advance(ws_ring &r) {
    if (++r.stage == WS_STAGES) {
        r.stage = 0;
        r.phase ^= 1;
    }
}

static __device__ __forceinline__ int ws_ktiles(const tile_operands &op) { return (int)((op.k + TILE_BK - 1) / TILE_BK); }

/* Producer, one stage: the WS_LOADERS threads (tid) copy A and B's 64-k slice at k0 (tile_operands.cuh's
 * layout): 1024 16-byte chunks of A, 2048 of B. */
#define WS_LOAD_ITERS ((1024 + WS_LOADERS - 1) / WS_LOADERS)
#define WS_LOAD_ITERS_B ((64 * TILE_BN / 8 + WS_LOADERS - 1) / WS_LOADERS)
template <bool A_MN, bool B_MN>
static __device__ __forceinline__ void ws_load_stage(uint32_t a_base, const tile_operands &op, long long k0, int tid) {
    const uint32_t b_base = a_base + WS_A_BYTES;
    if (A_MN) {
#pragma unroll 2
        for (int i = 0; i < WS_LOAD_ITERS; ++i) {
            int idx = tid + i * WS_LOADERS;
            if (idx >= 1024) break;
            int krow = idx >> 4, c = idx & 15, half = c >> 3, chunk = c & 7;
            long long k = k0 + krow;
            bool valid = k < op.k_valid && half * 64 < op.a_rows;
            const uint16_t *src = valid ? op.a + k * op.lda + half * 64 + chunk * 8 : op.a;
            cp_async_16(a_base + half * WS_HALF_BYTES + swizzle(krow, chunk), src, valid);
        }
    } else {
#pragma unroll 2
        for (int i = 0; i < WS_LOAD_ITERS; ++i) {
            int idx = tid + i * WS_LOADERS;
            if (idx >= 1024) break;
            int row = idx >> 3, chunk = idx & 7;
            bool valid = row < op.a_rows;
            const uint16_t *src = op.a + (valid ? row * op.lda : 0) + k0 + chunk * 8;
            cp_async_16(a_base + swizzle(row, chunk), src, valid);
        }
    }
    constexpr int B_CHUNKS = 64 * TILE_BN / 8;
    if (B_MN) { /* 64 k rows of WS_B_BLOCKS x 8 chunks */
#pragma unroll 2
        for (int i = 0; i < WS_LOAD_ITERS_B; ++i) {
            int idx = tid + i * WS_LOADERS;
            if (idx >= B_CHUNKS) break;
            int krow = idx / (8 * WS_B_BLOCKS), c = idx % (8 * WS_B_BLOCKS), block = c >> 3, chunk = c & 7;
            long long k = k0 + krow;
            bool valid = k < op.k_valid && block * 64 < op.n_valid;
            const uint16_t *src = op.b_lo;
            if (valid) src = (k < op.k_split ? op.b_lo + k * op.ldb : op.b_hi + (k - op.k_split) * op.ldb) + block * 64 + chunk * 8;
            cp_async_16(b_base + block * WS_HALF_BYTES + swizzle(krow, chunk), src, valid);
        }
    } else { /* TILE_BN rows of 8 chunks */
#pragma unroll 2
        for (int i = 0; i < WS_LOAD_ITERS_B; ++i) {
            int idx = tid + i * WS_LOADERS;
            if (idx >= B_CHUNKS) break;
            int row = idx >> 3, chunk = idx & 7;
            const bool lo = row < 64 * op.b_split;
            const uint16_t *base = lo ? op.b_lo : op.b_hi;
            const long long r = lo ? row : row - 64 * op.b_split;
            bool valid = base != nullptr && row < op.n_valid;
            const uint16_t *src = valid ? base + r * op.ldb + k0 + chunk * 8 : op.b_lo;
            cp_async_16(b_base + swizzle(row, chunk), src, valid);
        }
    }
}

/* Producer: every stage of one GEMM, in ring order. */
template <bool A_MN, bool B_MN>
static __device__ void ws_produce_gemm(ws_ring &r, const tile_operands &op, int tid) {
    const int ktiles = ws_ktiles(op);
    for (int kt = 0; kt < ktiles; ++kt) {
        mbar_wait(r.empty + 8 * r.stage, r.phase ^ 1, r.abort, r.error, r.timeout_ns);
        ws_load_stage<A_MN, B_MN>(r.stages + r.stage * WS_STAGE_BYTES, op, (long long)kt * TILE_BK, tid);
        cp_async_arrive(r.full + 8 * r.stage);
        ring_advance(r);
    }
}

/* Producer, TMA: thread 0 arms full[s] with the stage's byte count and issues the boxes; the
 * other loaders arrive plainly, so full[s] keeps its count of WS_LOADERS on both paths. */
static __device__ void ws_produce_tma(ws_ring &r, const tile_operands &op, int tid) {
    const int ktiles = ws_ktiles(op);
    const uint32_t bytes = (op.a_halves + op.b_halves) * WS_HALF_BYTES;
    for (int kt = 0; kt < ktiles; ++kt) {
        mbar_wait(r.empty + 8 * r.stage, r.phase ^ 1, r.abort, r.error, r.timeout_ns);
        const uint32_t a = r.stages + r.stage * WS_STAGE_BYTES, full = r.full + 8 * r.stage;
        if (tid == 0) {
            const int k0 = kt * TILE_BK;
            mbar_arrive_expect_tx(full, bytes);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (h >= op.a_halves) break;
                if (!op.a_mmajor) tma_load_2d(a + h * WS_HALF_BYTES, r.maps + op.a_map, k0, op.a_row + 64 * h, full);
                else tma_load_2d(a + h * WS_HALF_BYTES, r.maps + op.a_map, op.a_col + 64 * h, op.a_row + k0, full);
            }
            /* (the arrays are indexed by constants or selects only: no local memory) */
            const bool second = k0 >= op.k_split;
            const int map_n = second ? op.b_map[1] : op.b_map[0];
            const int krow = second ? op.b_row[1] + k0 - (int)op.k_split : op.b_row[0] + k0;
#pragma unroll
            for (int h = 0; h < WS_B_BLOCKS; ++h) {
                if (h >= op.b_halves) break;
                const uint32_t dst = a + WS_A_BYTES + h * WS_HALF_BYTES;
                const bool lo = h < op.b_split;
                if (!op.b_nmajor)
                    tma_load_2d(dst, r.maps + (lo ? op.b_map[0] : op.b_map[1]), k0,
                                lo ? op.b_row[0] + 64 * h : op.b_row[1] + 64 * (h - op.b_split), full);
                else tma_load_2d(dst, r.maps + map_n, op.b_col + 64 * h, krow, full);
            }
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
static __device__ __forceinline__ void ws_consume_gemm(ws_ring &r, const tile_operands &op, float (&acc)[WS_ACC]) {
    const int ktiles = ws_ktiles(op), consumer = (threadIdx.x >> 7) - 1, lane = threadIdx.x & 31;
    if (ktiles == 0) return;

    const uint32_t a_lbo = A_MN ? WS_HALF_BYTES : 16, b_lbo = B_MN ? WS_HALF_BYTES : 16;
    const uint32_t k16 = A_MN ? 2048 : 32, k16b = B_MN ? 2048 : 32;
    int prev = 0;
    for (int kt = 0; kt < ktiles; ++kt) {
        mbar_wait(r.full + 8 * r.stage, r.phase, r.abort, r.error, r.timeout_ns);
        __syncwarp();
        if (!op.tma) fence_proxy_async(); /* TMA writes through the async proxy already */
        const uint32_t a = r.stages + r.stage * WS_STAGE_BYTES, b = a + WS_A_BYTES;
        const uint32_t a_half = a + consumer * WS_HALF_BYTES;
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
static __device__ __forceinline__ void ws_acc_position(int i, int *row, int *col) {
    const int t = threadIdx.x - WS_PRODUCERS, lane = t & 31;
    *row = (t >> 5) * 16 + (lane >> 2) + ((i & 2) ? 8 : 0);
    *col = (i >> 2) * 8 + 2 * (lane & 3) + (i & 1);
}

/* Four 8 x 8 bf16 matrices into shared memory in one instruction (stmatrix): v[m] is this
 * thread's element pair of matrix m (row lane / 4, columns 2 (lane % 4), +1: the accumulator
 * fragment's layout), and lane L gives the address of row L % 8 of matrix L / 8 (16 bytes). */
static __device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v0), "r"(v1),
                 "r"(v2), "r"(v3)
                 : "memory");
}

/* The two shared-memory layouts bf16 tiles are written in: the staging tile c[128][TILE_C_LD]
 * (rows padded against bank conflicts), and 128-row x 64-column boxes of 128-byte rows swizzled
 * by 16-byte chunk (the TMA stores' layout, swizzle() of tile_operands.cuh), box after box. */
#define STSM_PADDED 0
#define STSM_BOXES 1
#define WS_STORE_BOX_BYTES (TILE_BM * 128)

/* The shared address of 8-column block `block` of row `row` in a LAYOUT tile at `base`. */
template <int LAYOUT>
static __device__ __forceinline__ uint32_t stsm_row_addr(uint32_t base, int row, int block) {
    if (LAYOUT == STSM_PADDED) return base + row * (TILE_C_LD * 2) + block * 16;
    return base + (block / 8) * WS_STORE_BOX_BYTES + swizzle(row, block % 8);
}

/* A warp's bf16 pairs of column blocks b and b + 1 of its 16 rows from row0, already packed:
 * v0, v1 block b's rows 0-7 and 8-15, v2, v3 block b + 1's (stmatrix's matrices 0-3). */
template <int LAYOUT>
static __device__ __forceinline__ void stsm_pairs(uint32_t base, int row0, int b, uint32_t v0, uint32_t v1, uint32_t v2,
                                                  uint32_t v3) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    stsm_x4(stsm_row_addr<LAYOUT>(base, row0 + 8 * (m & 1) + (lane & 7), b + (m >> 1)), v0, v1, v2, v3);
}

/* A warp's bf16 of the accumulators' column blocks j and j + 1 (8 columns each: accumulators
 * 4 j .. 4 j + 7), its 16 rows from row0, by one stmatrix: matrix m is block j + m / 2, rows
 * 8 (m % 2) .. + 7. In the tile, block j lands at block j - block0. */
template <int LAYOUT>
static __device__ __forceinline__ void stsm_blocks(const float (&acc)[WS_ACC], int j, uint32_t base, int row0,
                                                   int block0) {
    stsm_pairs<LAYOUT>(base, row0, j - block0, bf16x2_from_f32(acc[4 * j], acc[4 * j + 1]),
                       bf16x2_from_f32(acc[4 * j + 2], acc[4 * j + 3]), bf16x2_from_f32(acc[4 * j + 4], acc[4 * j + 5]),
                       bf16x2_from_f32(acc[4 * j + 6], acc[4 * j + 7]));
}

/* Rows < rows, columns < cols (a multiple of 8) of the staging tile c[128][TILE_C_LD] to out
 * (row stride ld; out and ld 16-byte aligned), in 16-byte chunks: each warp's store covers whole
 * chunks of one row. With a row map, row r goes to row rowmap[r] of out instead of row r. */
template <bool MAPPED = false>
static __device__ __forceinline__ void copy_staged(const uint16_t *c, int rows, int cols, uint16_t *out, long long ld,
                                                   const int32_t *rowmap = nullptr) {
    const int t = threadIdx.x - WS_PRODUCERS;
    for (int idx = t; idx < TILE_BM * (TILE_C_COLS / 8); idx += WS_CONSUMERS) {
        const int r = idx / (TILE_C_COLS / 8), c8 = (idx % (TILE_C_COLS / 8)) * 8;
        if (r < rows && c8 < cols) {
            const long long orow = MAPPED ? (long long)rowmap[r] : r;
            *(int4 *)(out + orow * ld + c8) = *(const int4 *)(c + r * TILE_C_LD + c8);
        }
    }
}

/* Rounds the accumulators of columns 0 .. TILE_C_COLS - 1 to bf16 into the staging tile
 * c[128][TILE_C_LD], then syncs the consumers. */
static __device__ __forceinline__ void ws_stage_bf16(uint16_t *c, const float (&acc)[WS_ACC]) {
    const int t = threadIdx.x - WS_PRODUCERS;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(c);
#pragma unroll
    for (int j = 0; j < TILE_C_COLS / 8; j += 2) stsm_blocks<STSM_PADDED>(acc, j, base, (t >> 5) * 16, 0);
    consumer_sync();
}

/* A tile's bf16 through the staging tile c[128][TILE_C_LD], TILE_C_COLS columns at a time:
 * rows < rows, columns < cols (a multiple of 8) of out + n0, row stride ld (out + n0 and ld
 * 16-byte aligned). Each warp's global store then covers whole 16-byte chunks of one row
 * rather than 4 bytes of 8 rows. The consumers sync before each round's copy and after it, so
 * c is free again on return. */
template <bool MAPPED = false>
static __device__ __forceinline__ void store_staged(const float (&acc)[WS_ACC], int rows, int cols, uint16_t *out,
                                                    long long ld, long long n0, uint16_t *c,
                                                    const int32_t *rowmap = nullptr) {
    const int t = threadIdx.x - WS_PRODUCERS;
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(c);
#pragma unroll
    for (int h = 0; h < WS_ACC / 4 / (TILE_C_COLS / 8); ++h) {
        if (h * TILE_C_COLS >= cols) break;
#pragma unroll
        for (int j = 0; j < TILE_C_COLS / 8; j += 2)
            stsm_blocks<STSM_PADDED>(acc, j + h * (TILE_C_COLS / 8), base, (t >> 5) * 16, h * (TILE_C_COLS / 8));
        consumer_sync();
        copy_staged<MAPPED>(c, rows, cols - h * TILE_C_COLS, out + n0 + h * TILE_C_COLS, ld, rowmap);
        consumer_sync();
    }
}

#endif
