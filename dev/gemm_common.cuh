/* gemm_common.cuh — what the dev GEMM experiments share (gemm_wgmma_v1, the pingpong, async-store,
 * deferred-epilogue, gather and multicast probes, fp8_tile_probe): error checks, the CTA's thread
 * layout (one producer warpgroup, two consumer warpgroups) and its shared memory, the experiments' own PTX
 * helpers beside the library's wrappers (src/cuda/sm90/ptx.cuh; here: a bounded mbarrier wait that
 * reports a code, the m64n128 wgmma), the cooperative K loop and the TMA producer, the staged C
 * store, the fp32 reference GEMM, random inputs, tensor maps, the comparison against the reference
 * and the event timer. Included by exactly one translation unit per program. Build with -Isrc. */
#pragma once
#include <cuda.h>  // CUtensorMap and its enums only: the driver entry point comes through cudart
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#ifdef WITH_CUBLAS
#include <cublas_v2.h>
#endif

#include "cuda/sm90/ptx.cuh" /* the library's PTX wrappers: mbarrier, TMA, wgmma, setmaxnreg */

typedef __nv_bfloat16 bf16;

/* ------------------------------------------------------------------------------------------ */
/* Error checking: every runtime, driver and cuBLAS call goes through one of these.           */

#define CUDA_CHECK(call)                                                                              \
    do {                                                                                              \
        cudaError_t err_ = (call);                                                                    \
        if (err_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "%s:%d: %s failed: %s (%s)\n", __FILE__, __LINE__, #call,                \
                    cudaGetErrorName(err_), cudaGetErrorString(err_));                                \
            exit(2);                                                                                  \
        }                                                                                             \
    } while (0)

#define CHECK(cond, ...)                                                                              \
    do {                                                                                              \
        if (!(cond)) {                                                                                \
            fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                                           \
            fprintf(stderr, __VA_ARGS__);                                                             \
            fprintf(stderr, "\n");                                                                    \
            exit(2);                                                                                  \
        }                                                                                             \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* Tile configuration.                                                                        */

constexpr int BM = 128;              // rows of C per tile: two consumer warpgroups of 64 rows
constexpr int BK = 64;               // K per stage: 64 bf16 = 128 bytes, one 128B swizzle row
constexpr int WG_THREADS = 128;
constexpr int NUM_CONSUMERS = 2;
constexpr int THREADS = WG_THREADS * (1 + NUM_CONSUMERS);  // producer warpgroup + consumers
constexpr int PRODUCER_REGS = 40;    // setmaxnreg budget: 128·40 + 256·232 = 64,512 <= 65,536
constexpr int CONSUMER_REGS = 232;
constexpr int SWIZZLE_ATOM_BYTES = 1024;  // 8 rows x 128 bytes: the repeat of the 128B swizzle
constexpr long long WAIT_TIMEOUT_NS = 4000000000ll;  // a barrier wait longer than this is a bug

// Error codes the kernel leaves in *err (host prints them).
enum {
    KERNEL_OK = 0,
    KERNEL_FULL_TIMEOUT = 1,
    KERNEL_EMPTY_TIMEOUT = 2,
    KERNEL_ORDER_TIMEOUT = 3,
    KERNEL_SMEM_MISALIGNED = 4,
    KERNEL_HANDOFF_TIMEOUT = 5
};


/* ------------------------------------------------------------------------------------------ */
/* PTX wrappers.                                                                              */

// Makes the barrier initialisation visible to the async proxy (TMA completes tx on it).
static __device__ __forceinline__ void fence_barrier_init() {
    mbar_init_fence();
    fence_proxy_async();
}

static __device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Waits for the phase of `bar` with the given parity. NOTE: a deadlocked pipeline must not hang
 * a lent GPU: after WAIT_TIMEOUT_NS the first waiter records `code` in *err and every later or
 * concurrent waiter sees the flag and gives up too, so the kernel ends and the host reports it.
 * The fast path (barrier already complete) costs one try_wait. */
static __device__ __forceinline__ bool mbar_wait(uint32_t bar, uint32_t parity, int *err, int code) {
    if (mbar_try_wait(bar, parity)) return true;
    const uint64_t start = globaltimer_ns();
    for (uint32_t spins = 1;; ++spins) {
        if (mbar_try_wait(bar, parity)) return true;
        if ((spins & 1023) == 0) {
            if (*(volatile int *)err != KERNEL_OK) return false;
            if (globaltimer_ns() - start > (uint64_t)WAIT_TIMEOUT_NS) {
                atomicCAS(err, KERNEL_OK, code);
                return false;
            }
        }
    }
}

static __device__ __forceinline__ void prefetch_tensormap(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)map) : "memory");
}

/* Keeps the compiler from moving reads or writes of the accumulators across the asynchronous
 * region (the wgmma asm names them, but the wait does not). */
template <int R>
static __device__ __forceinline__ void pin_accumulators(float (&acc)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

/* Shared-memory descriptors (the library's smem_desc): a K-major operand in 128B-swizzled 128-byte
 * rows (leading offset unused, 16 bytes; 8-row groups 1024 bytes apart; +16 k = +32 bytes), and
 * an MN-major one (64-wide rows of M or N, one per k; 8-k groups 1024 bytes apart, consecutive
 * 64-wide halves 8 KB apart; +16 k = +2048 bytes). */
static __device__ __forceinline__ uint64_t make_smem_desc(uint32_t addr) { return smem_desc(addr, 16); }
static __device__ __forceinline__ uint64_t make_smem_desc_mn(uint32_t addr) { return smem_desc(addr, 8192); }

/* D[64 x 128] (+)= A[64 x 16] · B[16 x 128] (the library has only the m64n256 form). */
template <int TA, int TB>
static __device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                        int scale_d) {
    asm volatile("{\n.reg .pred p;\n"
                 "setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MOK_WGMMA_D64
                 ", %64, %65, p, 1, 1, %67, %68;\n}\n"
                 : MOK_WGMMA_ACC64(d)
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB)
                 : "memory");
}

template <int ACC, int TA, int TB>
static __device__ __forceinline__ void wgmma_tile(float (&d)[ACC], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    if constexpr (ACC == 128)
        wgmma_m64n256k16<TA, TB>(d, desc_a, desc_b, scale_d);
    else
        wgmma_m64n128k16<TA, TB>(d, desc_a, desc_b, scale_d);
}

/* The epilogue probes' synthetic epilogue: iters passes of four FMA chains over 128 accumulators. The result is
 * stored only if it equals a value it never takes, which keeps the work from being removed. */
static __device__ __forceinline__ void busy_epilogue(const float (&lo)[64], const float (&hi)[64], int iters,
                                                     float *sink) {
    float x0 = 0.0f, x1 = 0.0f, x2 = 0.0f, x3 = 0.0f;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < 64; i += 4) {
            x0 = fmaf(lo[i], x0, 0.5f);
            x1 = fmaf(lo[i + 1], x1, 0.5f);
            x2 = fmaf(hi[i + 2], x2, 0.5f);
            x3 = fmaf(hi[i + 3], x3, 0.5f);
        }
#pragma unroll
        for (int i = 0; i < 64; i += 4) {
            x0 = fmaf(hi[i], x0, 0.25f);
            x1 = fmaf(hi[i + 1], x1, 0.25f);
            x2 = fmaf(lo[i + 2], x2, 0.25f);
            x3 = fmaf(lo[i + 3], x3, 0.25f);
        }
    }
    if (x0 + x1 + x2 + x3 == -12345.0f) *sink = x0;
}

/* The two consumer warpgroups' named barrier (1; the producer never joins it). */
static __device__ __forceinline__ void consumer_bar() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
}

/* A warp's 16 rows from row0 of 8-column blocks j and j + 1 of the accumulators by one stmatrix,
 * into a padded bf16 tile at `base` (row stride ld bf16): block j lands at block j - block0. */
static __device__ __forceinline__ void stsm_padded(const float (&acc)[128], int j, uint32_t base, int ld, int row0,
                                                   int block0) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    const int r = row0 + 8 * (m & 1) + (lane & 7), b = j + (m >> 1) - block0;
    stsm_x4(base + r * (ld * 2) + b * 16, pack_bf16(acc[4 * j], acc[4 * j + 1]), pack_bf16(acc[4 * j + 2], acc[4 * j + 3]),
            pack_bf16(acc[4 * j + 4], acc[4 * j + 5]), pack_bf16(acc[4 * j + 6], acc[4 * j + 7]));
}

/* C's 128 x 256 tile at (m0, n0) out as the library's epilogues store it: rounded to bf16 into a
 * padded staging tile (row stride LD bf16, at least 128 + 8) by stmatrix, a consumer sync, then
 * 16-byte chunks out, each warp's store whole chunks of one row, a sync; one 128-column half at a
 * time. Rows and columns past M, N are not stored. */
template <int LD>
static __device__ __forceinline__ void store_c_staged(const float (&acc)[128], uint32_t staging, const bf16 *staging_ptr,
                                                      bf16 *C, int M, int N, int m0, int n0) {
    const int ctid = threadIdx.x - WG_THREADS, row0 = (ctid >> 5) * 16;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 16 * h; j < 16 * h + 16; j += 2) stsm_padded(acc, j, staging, LD, row0, 16 * h);
        consumer_bar();
        for (int idx = ctid; idx < BM * 16; idx += 256) {
            const int r = idx >> 4, c8 = (idx & 15) * 8, row = m0 + r, col = n0 + 128 * h + c8;
            if (row < M && col < N)
                *reinterpret_cast<int4 *>(C + (size_t)row * N + col) = *reinterpret_cast<const int4 *>(staging_ptr + r * LD + c8);
        }
        consumer_bar();
    }
}

/* Where the cooperative consumers stand in the ring: the next stage to read, its parity, and the
 * stage whose release is pending. It carries from tile to tile. */
struct RingCursor {
    int stage = 0, prev = 0;
    uint32_t phase = 0;
};

/* What coop_k_loop runs between committing a stage's wgmmas and waiting for the group before:
 * nothing, or a probe's work that keeps off the accumulators. */
struct NoHook {
    __device__ __forceinline__ void operator()() const {}
};

/* How a consumer warp's lane 0 releases a stage: an arrival on this CTA's empty barrier. A
 * probe whose stages other CTAs also fill passes its own (arrivals on theirs too). */
struct LocalRelease {
    __device__ __forceinline__ void operator()(uint32_t empty) const { mbar_arrive(empty); }
};

/* The cooperative consumers' K loop over one tile: num_k stages from the cursor, BK / 16 wgmmas
 * each into acc (the first with scale-d 0), one group kept in flight; stage s is released (lane 0
 * of every warp calls release(empty[s])) once the group that read it is done, the last one after
 * the final wait. desc_a0 / desc_b0 address stage 0, step_a / step_b are 16 more k in descriptor
 * units. FENCE: a proxy fence after each full wait (a stage written by cp.async, the generic proxy,
 * is read by the wgmmas through the async one). hook() runs after each stage's commit. Returns
 * false, the wgmmas drained, when a full-barrier wait gave up (*err says why). */
template <int STAGES, int STAGE_BYTES, int ACC, int TA, int TB, bool FENCE = false, class Hook = NoHook,
          class Release = LocalRelease>
static __device__ __forceinline__ bool coop_k_loop(float (&acc)[ACC], RingCursor &cur, uint32_t full_bar,
                                                   uint32_t empty_bar, uint64_t desc_a0, uint64_t desc_b0,
                                                   uint64_t step_a, uint64_t step_b, int num_k, int *err,
                                                   Hook hook = Hook(), Release release = Release()) {
    const int lane = threadIdx.x % 32;
    for (int kb = 0; kb < num_k; ++kb) {
        if (!mbar_wait(full_bar + 8 * cur.stage, cur.phase, err, KERNEL_FULL_TIMEOUT)) {
            wgmma_wait<0>();
            return false;
        }
        // Threads leave the spin loop one by one; the wgmma instructions are .sync.aligned and
        // need the whole warp converged.
        __syncwarp();
        if (FENCE) fence_proxy_async();
        const uint64_t off = (uint64_t)((cur.stage * STAGE_BYTES) >> 4);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; ++k)
            wgmma_tile<ACC, TA, TB>(acc, desc_a0 + off + step_a * k, desc_b0 + off + step_b * k, (kb | k) != 0);
        wgmma_commit();
        hook();
        // Keep one wgmma group in flight: when this returns, the group that read the previous
        // slot is complete and that slot can be refilled.
        wgmma_wait<1>();
        if (kb > 0 && lane == 0) release(empty_bar + 8 * cur.prev);
        cur.prev = cur.stage;
        if (++cur.stage == STAGES) {
            cur.stage = 0;
            cur.phase ^= 1;
        }
    }
    wgmma_wait<0>();
    pin_accumulators(acc);
    if (lane == 0) release(empty_bar + 8 * cur.prev);
    return true;
}

/* The shared memory of a cooperative tile with a staging region (Cfg: STAGES, STAGE_BYTES,
 * STAGING_BYTES): the ring from the first 1024-byte boundary (the 128B swizzle's atom), the staging
 * region after it, then STAGES full and STAGES empty barriers. Cfg::SMEM_BYTES counts them all and
 * the alignment. */
struct StagedSmem {
    uint32_t ring, staging, full_bar, empty_bar;
    uint8_t *staging_ptr;
};
template <class Cfg>
static __device__ __forceinline__ StagedSmem staged_smem(uint8_t *smem_raw) {
    StagedSmem s;
    const uint32_t raw = smem_addr(smem_raw);
    s.ring = (raw + SWIZZLE_ATOM_BYTES - 1) & ~(uint32_t)(SWIZZLE_ATOM_BYTES - 1);
    s.staging = s.ring + Cfg::STAGES * Cfg::STAGE_BYTES;
    s.full_bar = s.staging + Cfg::STAGING_BYTES;
    s.empty_bar = s.full_bar + Cfg::STAGES * 8;
    s.staging_ptr = smem_raw + (s.staging - raw);
    return s;
}

/* Thread 0 initialises the ring's barriers (full: full_count arrivals; empty: one per consumer
 * warp) for the async proxy too; then the whole CTA syncs. */
template <int STAGES>
static __device__ __forceinline__ void ring_barriers_init(uint32_t full_bar, uint32_t empty_bar, uint32_t full_count) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8 * s, full_count);
            mbar_init(empty_bar + 8 * s, 8);
        }
        fence_barrier_init();
    }
    __syncthreads();
}

/* ------------------------------------------------------------------------------------------ */
/* Tile order and the producer, for a tile configuration Cfg with BN (columns per tile), STAGES,
 * A_BYTES, STAGE_BYTES and GROUP_N.                                                          */

/* The cooperative 128 x 256 tile of the library (gemm_tile.cuh): its ring of 3 stages of 48 KB and
 * its tile order (bands of 2048 columns). The epilogue probes' configurations extend it with
 * their staging region and SMEM_BYTES. */
struct Coop256Config {
    static constexpr int BN = 256;
    static constexpr int STAGES = 3;
    static constexpr int A_BYTES = BM * BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + BN * BK * 2;
    static constexpr int GROUP_N = 2048 / BN;
};

struct TilePos {
    int m0, n0;
};

/* Linear tile id -> (m0, n0). Tiles go in bands of GROUP_N column blocks (2048 columns of C), and
 * within a band the column block runs fastest: the ~132 tiles in flight at once cover ~16 row
 * blocks x 8 column blocks (BN 256), the band's B panel (2048 x K) stays in L2 while the band
 * walks down M, and each A row panel is read from HBM once per band. Producer and consumers call
 * this with the same arguments, so they agree on the order. */
template <class Cfg>
static __device__ __forceinline__ TilePos tile_at(int tile, int num_m, int num_n) {
    const int band_tiles = Cfg::GROUP_N * num_m;
    const int band = tile / band_tiles;
    const int first_n = band * Cfg::GROUP_N;
    const int width = min(Cfg::GROUP_N, num_n - first_n);
    const int local = tile - band * band_tiles;
    TilePos p;
    p.m0 = (local / width) * BM;
    p.n0 = (first_n + local % width) * Cfg::BN;
    return p;
}

/* The producer thread: every TMA load of the CTA's tiles (blockIdx.x, + gridDim.x, ...), num_k
 * slices of BK each, into the STAGES-deep ring; full[s] gets the stage's byte count, and a slot
 * is refilled once empty[s] has completed (the consumers' count). TA: A is MN-major (At[K, M],
 * two boxes of 64 m); TB: B is MN-major (Bt[K, N], BN / 64 boxes of 64 n). Returns early if a
 * wait timed out (the code is in *err). */
template <class Cfg, int TA, int TB>
static __device__ __forceinline__ void produce_tiles(const CUtensorMap *map_a, const CUtensorMap *map_b, uint32_t ring,
                                                     uint32_t full_bar, uint32_t empty_bar, int num_m, int num_n,
                                                     int num_k, int *err) {
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        for (int kb = 0; kb < num_k; ++kb) {
            if (!mbar_wait(empty_bar + 8 * stage, phase ^ 1, err, KERNEL_EMPTY_TIMEOUT)) return;
            const uint32_t a_dst = ring + stage * Cfg::STAGE_BYTES;
            mbar_arrive_expect_tx(full_bar + 8 * stage, Cfg::STAGE_BYTES);
            if (TA) /* At[K, M]: two boxes of 64 m x 64 k */
                for (int h = 0; h < BM / 64; ++h)
                    tma_load_2d(a_dst + h * 8192, map_a, pos.m0 + 64 * h, kb * BK, full_bar + 8 * stage);
            else
                tma_load_2d(a_dst, map_a, kb * BK, pos.m0, full_bar + 8 * stage);
            if (TB) /* Bt[K, N]: BN / 64 boxes of 64 n x 64 k */
                for (int h = 0; h < Cfg::BN / 64; ++h)
                    tma_load_2d(a_dst + Cfg::A_BYTES + h * 8192, map_b, pos.n0 + 64 * h, kb * BK,
                                full_bar + 8 * stage);
            else
                tma_load_2d(a_dst + Cfg::A_BYTES, map_b, kb * BK, pos.n0, full_bar + 8 * stage);
            if (++stage == Cfg::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
}

/* The cooperative consumers' walk over the CTA's tiles (K-major A and B): each tile's main loop
 * into the accumulators, then epilogue(acc, pos, t), t counting the CTA's tiles from 0. False when
 * a wait gave up (the main loop's, or the epilogue's returning false). */
template <class Cfg, class Epilogue>
static __device__ __forceinline__ bool consume_tiles(uint32_t ring, uint32_t full_bar, uint32_t empty_bar, int num_m,
                                                     int num_n, int num_k, int *err, Epilogue epilogue) {
    const int consumer = threadIdx.x / WG_THREADS - 1;
    const uint64_t desc_a0 = make_smem_desc(ring + consumer * 64 * 128), desc_b0 = make_smem_desc(ring + Cfg::A_BYTES);
    float acc[128];
    RingCursor cur;
    int t = 0;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x, ++t) {
        if (!coop_k_loop<Cfg::STAGES, Cfg::STAGE_BYTES, 128, 0, 0>(acc, cur, full_bar, empty_bar, desc_a0, desc_b0, 2,
                                                                   2, num_k, err))
            return false;
        if (!epilogue(acc, tile_at<Cfg>(tile, num_m, num_n), t)) return false;
    }
    return true;
}

/* The roles of a cooperative CTA whose producer is produce_tiles (K-major A and B): warpgroup 0
 * gives registers back and its thread 0 streams every stage of the CTA's tiles, then returns
 * false; the consumer warpgroups take their registers and get true. */
template <class Cfg>
static __device__ __forceinline__ bool consumer_role(const CUtensorMap *map_a, const CUtensorMap *map_b, uint32_t ring,
                                                     uint32_t full_bar, uint32_t empty_bar, int num_m, int num_n,
                                                     int num_k, int *err) {
    if (threadIdx.x / WG_THREADS == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) produce_tiles<Cfg, 0, 0>(map_a, map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        return false;
    }
    setmaxnreg_inc<CONSUMER_REGS>();
    return true;
}

/* ------------------------------------------------------------------------------------------ */
/* Reference and input kernels.                                                               */

/* One thread per output, fp32 accumulate, 8 elements of K per 16-byte load (K % 8 == 0).
 * Blocks of 32 (n) x 8 (m) threads: a warp shares one row of A (broadcast) and the block's 8
 * warps share the same 32 rows of B through L1, which keeps the largest shape at seconds, not
 * minutes, without making the reference any less obvious. */
constexpr int REF_BLOCK_N = 32, REF_BLOCK_M = 8;
__global__ void reference_gemm(const bf16 *__restrict__ A, const bf16 *__restrict__ B, float *__restrict__ C,
                               int M, int N, int K) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (n >= N || m >= M) return;
    const uint4 *a = reinterpret_cast<const uint4 *>(A + (size_t)m * K);
    const uint4 *b = reinterpret_cast<const uint4 *>(B + (size_t)n * K);
    float sum = 0.0f;
    for (int k8 = 0; k8 < K / 8; ++k8) {
        const uint4 va = a[k8], vb = b[k8];
        const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            sum += __uint_as_float(wa[j] << 16) * __uint_as_float(wb[j] << 16);
            sum += __uint_as_float(wa[j] & 0xFFFF0000u) * __uint_as_float(wb[j] & 0xFFFF0000u);
        }
    }
    C[(size_t)m * N + n] = sum;
}

/* Random bf16 with magnitude in [1/16, 1): never zero, signs mixed, a pure function of
 * (seed, index) so a failing run can be replayed from the printed seed. */
__global__ void fill_random(bf16 *x, size_t count, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        const float mag = 0.0625f + 0.9375f * u;
        x[i] = __float2bfloat16_rn((z & 1) ? -mag : mag);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Host side.                                                                                 */

static PFN_cuTensorMapEncodeTiled_v12000 g_encode_tiled = nullptr;
static int g_num_sms = 0;

static void load_driver_entry_points() {
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    void *fn = nullptr;
#if CUDART_VERSION >= 12050
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &query));
#else
    CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &query));
#endif
    CHECK(query == cudaDriverEntryPointSuccess && fn != nullptr,
          "cuTensorMapEncodeTiled not found in the driver (query result %d)", (int)query);
    g_encode_tiled = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

/* A K-major bf16 matrix [rows, K] as a 2-D tensor map with box [box_rows, 64], 128B swizzle.
 * Rows past `rows` and columns past K come back as zeros. */
static CUtensorMap make_kmajor_map(const bf16 *ptr, int rows, int K, int box_rows, const char *what) {
    CHECK(((uintptr_t)ptr & 15) == 0, "%s: base address must be 16-byte aligned", what);
    CHECK(((size_t)K * sizeof(bf16)) % 16 == 0, "%s: row stride (K = %d) must be a multiple of 16 bytes", what, K);
    CUtensorMap map;
    memset(&map, 0, sizeof(map));
    const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)K * sizeof(bf16)};
    const cuuint32_t box[2] = {(cuuint32_t)BK, (cuuint32_t)box_rows};
    const cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = g_encode_tiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16 *>(ptr), dims, strides,
                                box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled(%s: rows %d, K %d, box %d x %d) failed with CUresult %d", what,
          rows, K, box_rows, BK, (int)r);
    return map;
}

/* An MN-major bf16 matrix Xt[K, cols] (cols contiguous) as a 2-D tensor map with boxes of 64
 * columns x 64 k, 128B swizzle. */
static CUtensorMap make_mn_map(const bf16 *ptr, int K, int cols, const char *what) {
    CHECK(((uintptr_t)ptr & 15) == 0, "%s: base address must be 16-byte aligned", what);
    CHECK(((size_t)cols * sizeof(bf16)) % 16 == 0, "%s: row stride (%d columns) must be a multiple of 16 bytes", what,
          cols);
    CUtensorMap map;
    memset(&map, 0, sizeof(map));
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)K};
    const cuuint64_t strides[1] = {(cuuint64_t)cols * sizeof(bf16)};
    const cuuint32_t box[2] = {64, (cuuint32_t)BK};
    const cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = g_encode_tiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16 *>(ptr), dims, strides,
                                box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled(%s: K %d, cols %d) failed with CUresult %d", what, K, cols,
          (int)r);
    return map;
}

/* dst[c, r] = src[r, c] for src [rows, cols]: the MN-major copies At and Bt. */
__global__ void transpose(const bf16 *__restrict__ src, bf16 *__restrict__ dst, int rows, int cols) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)rows * cols;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / cols, c = i % cols;
        dst[c * rows + r] = src[i];
    }
}

/* The operands of one run: K-major A[M, K] and B[N, K], and their MN-major copies (At[K, M],
 * Bt[K, N]) for the transposed layouts. */
struct Operands {
    const bf16 *A, *B, *At, *Bt;
};

/* Synchronises and turns a kernel-side error code into a message; returns false on error. */
static bool check_kernel_error(int *d_err, const char *what) {
    CUDA_CHECK(cudaDeviceSynchronize());
    int h_err = 0;
    CUDA_CHECK(cudaMemcpy(&h_err, d_err, sizeof(int), cudaMemcpyDeviceToHost));
    if (h_err == KERNEL_OK) return true;
    fprintf(stderr, "%s: kernel gave up: %s\n", what,
            h_err == KERNEL_FULL_TIMEOUT    ? "a consumer waited > 4 s on a full barrier (TMA never landed?)"
            : h_err == KERNEL_EMPTY_TIMEOUT ? "the producer waited > 4 s on an empty barrier (consumers stuck?)"
            : h_err == KERNEL_ORDER_TIMEOUT ? "a consumer waited > 4 s for the other one's turn (ping-pong order)"
            : h_err == KERNEL_SMEM_MISALIGNED ? "the dynamic shared memory is not 1024-byte aligned"
            : h_err == KERNEL_HANDOFF_TIMEOUT ? "a handoff of a tile between warpgroups waited > 4 s"
                                            : "unknown error code");
    CUDA_CHECK(cudaMemset(d_err, 0, sizeof(int)));
    return false;
}


/* Tolerances, and why:
 *   REL_TOL  2^-7: the output is bf16, whose round-to-nearest error is at most 2^-8 relative;
 *            twice that leaves room for the reference's different fp32 summation order.
 *   ABS_TOL  1e-3: outputs that are nearly zero by cancellation, where a relative bound means
 *            nothing; fp32 reordering over K <= 7168 terms of size < 1 stays far below this.
 * A layout or pipeline bug gives errors of order 1 or more (|C| ~ sqrt(K) / 2 here). */
constexpr double REL_TOL = 1.0 / 128.0;
constexpr double ABS_TOL = 1e-3;

struct CompareResult {
    double max_abs, max_rel;
    size_t bad, unwritten, guard_broken;
};

/* Compares C (bf16, poisoned with 0xFFFF = NaN before the run) against the fp32 reference;
 * also checks that `guard` elements after C are still poison (nothing written past the end). */
static CompareResult compare(const bf16 *d_C, const float *d_ref, int M, int N, size_t guard) {
    const size_t count = (size_t)M * N;
    std::vector<uint16_t> got(count + guard);
    std::vector<float> ref(count);
    CUDA_CHECK(cudaMemcpy(got.data(), d_C, (count + guard) * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(ref.data(), d_ref, count * sizeof(float), cudaMemcpyDeviceToHost));
    CompareResult r = {0.0, 0.0, 0, 0, 0};
    for (size_t i = 0; i < count; ++i) {
        uint32_t bits = (uint32_t)got[i] << 16;
        float g;
        memcpy(&g, &bits, 4);
        if (std::isnan(g)) {
            ++r.unwritten;
            continue;
        }
        const double e = std::fabs((double)g - (double)ref[i]), mag = std::fabs((double)ref[i]);
        r.max_abs = std::max(r.max_abs, e);
        if (mag > 1e-2) r.max_rel = std::max(r.max_rel, e / mag);
        if (!(e <= ABS_TOL + REL_TOL * mag)) ++r.bad;
    }
    for (size_t i = count; i < count + guard; ++i)
        if (got[i] != 0xFFFF) ++r.guard_broken;
    return r;
}

struct Shape {
    int M, N, K;
};

/* The forward's GEMMs of the benchmark's layers, with 16384 routed rows, which the epilogue probes
 * time. */
struct NamedShape {
    const char *name;
    Shape s;
};
static const NamedShape FORWARD_SHAPES[] = {
    {"dsv3 gate|up", {16384, 4096, 7168}},   {"dsv3 down", {16384, 7168, 2048}},
    {"qwen3 gate|up", {16384, 1536, 2048}},  {"qwen3 down", {16384, 2048, 768}},
    {"mixtral gate|up", {16384, 28672, 4096}}, {"mixtral down", {16384, 4096, 14336}}};

/* The operands' device buffers: A and B random (never zero, a pure function of the seed), room
 * for a_elems / b_elems, and At / Bt, which transpose_operands fills for one shape. */
struct DeviceOperands {
    bf16 *A, *B, *At, *Bt;
};

static DeviceOperands alloc_operands(size_t a_elems, size_t b_elems, uint64_t seed) {
    DeviceOperands d;
    CUDA_CHECK(cudaMalloc(&d.A, a_elems * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&d.B, b_elems * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&d.At, a_elems * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&d.Bt, b_elems * sizeof(bf16)));
    fill_random<<<1024, 256>>>(d.A, a_elems, seed);
    CUDA_CHECK(cudaGetLastError());
    fill_random<<<1024, 256>>>(d.B, b_elems, seed ^ 0x5DEECE66Dull);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    return d;
}

/* At, Bt: the MN-major copies of the shape's A[M, K] and B[N, K] prefixes. */
static void transpose_operands(const DeviceOperands &d, const Shape &s) {
    transpose<<<1024, 256>>>(d.A, d.At, s.M, s.K);
    CUDA_CHECK(cudaGetLastError());
    transpose<<<1024, 256>>>(d.B, d.Bt, s.N, s.K);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
}

/* ref[M, N] = A · B^T in fp32 (reference_gemm) for the shape's prefixes. */
static void run_reference(const DeviceOperands &d, float *ref, const Shape &s) {
    const dim3 block(REF_BLOCK_N, REF_BLOCK_M);
    const dim3 grid((s.N + REF_BLOCK_N - 1) / REF_BLOCK_N, (s.M + REF_BLOCK_M - 1) / REF_BLOCK_M);
    reference_gemm<<<grid, block>>>(d.A, d.B, ref, s.M, s.N, s.K);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
}

static void free_operands(const DeviceOperands &d) {
    CUDA_CHECK(cudaFree(d.A));
    CUDA_CHECK(cudaFree(d.B));
    CUDA_CHECK(cudaFree(d.At));
    CUDA_CHECK(cudaFree(d.Bt));
}

static double median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

constexpr int WARMUP_RUNS = 3;
constexpr int TIMED_RUNS = 20;
/* How long each timing first runs its own kernel back to back. Under sustained dense GEMMs an H200
 * reaches its power cap within ~0.2 s and its SM clock falls from 1980 MHz to ~1450-1600
 * (nvidia-smi: "SW power cap"); when the load lightens (a slower mode, a gap) the clock climbs
 * back within tens of ms. So a mode timed from idle, or right after a slower mode, runs its ~20
 * short launches at a higher clock than its own sustained one and would win by the clock alone.
 * Every timing therefore preheats on its own work: PREHEAT_FIRST_MS for a process's first,
 * PREHEAT_MS for the others, the state a training step's GEMMs run in. */
constexpr double PREHEAT_FIRST_MS = 1500.0;
constexpr double PREHEAT_MS = 400.0;

/* Median milliseconds of TIMED_RUNS launches of `run`, each bracketed by its own events, after
 * `run` back to back for the preheat above. */
template <class F>
static double time_median_ms(F run) {
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    static bool first = true;
    const double preheat_ms = first ? PREHEAT_FIRST_MS : PREHEAT_MS;
    first = false;
    CUDA_CHECK(cudaEventRecord(start));
    for (float busy = 0.0f; busy < preheat_ms;) {
        for (int i = 0; i < 8; ++i) run();
        CUDA_CHECK(cudaEventRecord(stop));
        CUDA_CHECK(cudaEventSynchronize(stop));
        CUDA_CHECK(cudaEventElapsedTime(&busy, start, stop));
    }
    for (int i = 0; i < WARMUP_RUNS; ++i) run();
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> ms(TIMED_RUNS);
    for (int i = 0; i < TIMED_RUNS; ++i) {
        CUDA_CHECK(cudaEventRecord(start));
        run();
        CUDA_CHECK(cudaEventRecord(stop));
        CUDA_CHECK(cudaEventSynchronize(stop));
        CUDA_CHECK(cudaEventElapsedTime(&ms[i], start, stop));
    }
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    return median(ms);
}

/* A probe's start: device 0 must be sm_90 with smem_bytes of shared memory per block; sets
 * g_num_sms and the driver's tensor-map encoder; the seed is argv[1] or the time, printed. */
static uint64_t probe_start(int argc, char **argv, size_t smem_bytes) {
    CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    CHECK(prop.major == 9 && prop.minor == 0, "%s is sm_%d%d; this program is built for sm_90a only", prop.name,
          prop.major, prop.minor);
    CHECK(smem_bytes <= prop.sharedMemPerBlockOptin, "not enough shared memory per block (%zu)",
          prop.sharedMemPerBlockOptin);
    g_num_sms = prop.multiProcessorCount;
    load_driver_entry_points();
    const uint64_t seed = argc > 1 ? strtoull(argv[1], nullptr, 0) : (uint64_t)time(nullptr);
    printf("device %s, %d SMs, seed %llu\n", prop.name, g_num_sms, (unsigned long long)seed);
    return seed;
}

/* ------------------------------------------------------------------------------------------ */
/* What the epilogue probes (pingpong_probe.cu, async_store_probe.cu) share on the host.      */

/* A probe kernel's side channels: stats[0] the ns its warpgroups spent in epilogues, stats[1] the
 * epilogues timed; a sink that keeps synthetic work alive; the error word. */
struct ProbeRun {
    unsigned long long *stats;
    float *sink;
    int *err;
};

/* Operands for the largest of the shapes, C with room for a guard past its end, the fp32
 * reference, and the side channels. */
struct ProbeBuffers {
    DeviceOperands dev;
    Operands ops;
    bf16 *C;
    size_t c_capacity;
    float *ref;
    ProbeRun run;
};

static ProbeBuffers probe_buffers(const std::vector<Shape> &shapes, uint64_t seed) {
    size_t a_elems = 0, b_elems = 0, c_elems = 0;
    for (const Shape &s : shapes) {
        a_elems = std::max(a_elems, (size_t)s.M * s.K);
        b_elems = std::max(b_elems, (size_t)s.N * s.K);
        c_elems = std::max(c_elems, (size_t)s.M * s.N);
    }
    ProbeBuffers b;
    b.dev = alloc_operands(a_elems, b_elems, seed);
    b.ops = {b.dev.A, b.dev.B, b.dev.At, b.dev.Bt};
    b.c_capacity = c_elems + (1 << 16);
    CUDA_CHECK(cudaMalloc(&b.C, b.c_capacity * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&b.ref, c_elems * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.run.sink, sizeof(float)));
    CUDA_CHECK(cudaMalloc(&b.run.stats, 2 * sizeof(unsigned long long)));
    CUDA_CHECK(cudaMalloc(&b.run.err, sizeof(int)));
    CUDA_CHECK(cudaMemset(b.run.err, 0, sizeof(int)));
    return b;
}

static void probe_buffers_free(const ProbeBuffers &b) {
    free_operands(b.dev);
    CUDA_CHECK(cudaFree(b.C));
    CUDA_CHECK(cudaFree(b.ref));
    CUDA_CHECK(cudaFree(b.run.sink));
    CUDA_CHECK(cudaFree(b.run.stats));
    CUDA_CHECK(cudaFree(b.run.err));
}

/* C and a guard after it poisoned, launch() (which writes s's C), then C against b.ref (the
 * caller ran run_reference for s): one line named `what`. */
template <class Launch>
static bool probe_self_test(const ProbeBuffers &b, const Shape &s, const char *what, Launch launch) {
    const size_t count = (size_t)s.M * s.N;
    const size_t guard = std::min<size_t>(b.c_capacity - count, 1 << 16);
    CUDA_CHECK(cudaMemset(b.C, 0xFF, (count + guard) * sizeof(bf16)));
    launch();
    if (!check_kernel_error(b.run.err, what)) {
        printf("FAIL  %-56s kernel error (see stderr)\n", what);
        return false;
    }
    const CompareResult c = compare(b.C, b.ref, s.M, s.N, guard);
    const bool ok = c.bad == 0 && c.unwritten == 0 && c.guard_broken == 0;
    printf("%s  %-56s max rel %.3e  bad %zu  unwritten %zu  past-end %zu\n", ok ? "ok  " : "FAIL", what, c.max_rel,
           c.bad, c.unwritten, c.guard_broken);
    return ok;
}

/* The grid of a persistent Cfg kernel (KERNEL) on s: a CTA per tile of 128 x Cfg::BN, at most one
 * per SM; the kernel's Cfg::SMEM_BYTES of shared memory allowed at its first launch. */
template <class Cfg, auto KERNEL>
static int persistent_grid(const Shape &s) {
    static bool attribute_set = false;
    if (!attribute_set) {
        CUDA_CHECK(cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::SMEM_BYTES));
        attribute_set = true;
    }
    const long long tiles = (long long)((s.M + BM - 1) / BM) * ((s.N + Cfg::BN - 1) / Cfg::BN);
    return (int)std::min<long long>(tiles, g_num_sms);
}

/* Launches a persistent epilogue-probe kernel KERNEL (map_a, map_b, C, M, N, K, iters, stats, sink,
 * err) of configuration Cfg on s: A and B K-major, boxes of 128 and Cfg::BN rows. */
template <class Cfg, auto KERNEL>
static void launch_epilogue_probe(const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    const int grid = persistent_grid<Cfg, KERNEL>(s);
    const CUtensorMap map_a = make_kmajor_map(o.A, s.M, s.K, BM, "A");
    const CUtensorMap map_b = make_kmajor_map(o.B, s.N, s.K, Cfg::BN, "B");
    KERNEL<<<grid, THREADS, Cfg::SMEM_BYTES>>>(map_a, map_b, C, s.M, s.N, s.K, iters, r.stats, r.sink, r.err);
    CUDA_CHECK(cudaGetLastError());
}

/* The epilogue probes' self-test shapes: edges (M not a multiple of 128, N not of 256, K not of
 * 64, one row, more tiles than SMs so that a staging region is reused) and one large. */
static const Shape EPILOGUE_TEST_SHAPES[] = {{1, 256, 64},       {77, 136, 72},     {300, 520, 1000},
                                             {1000, 768, 2048},  {4096, 8192, 512}, {4096, 2048, 7168}};

/* The buffers for those and FORWARD_SHAPES. */
static ProbeBuffers epilogue_probe_buffers(uint64_t seed) {
    std::vector<Shape> shapes(std::begin(EPILOGUE_TEST_SHAPES), std::end(EPILOGUE_TEST_SHAPES));
    for (const NamedShape &t : FORWARD_SHAPES) shapes.push_back(t.s);
    return probe_buffers(shapes, seed);
}

/* The median ms of launch(), then one more launch's mean µs per epilogue (the stats). */
template <class Launch>
static bool probe_time(const ProbeBuffers &b, const char *what, Launch launch, double *ms, double *epi_us) {
    *ms = time_median_ms(launch);
    CUDA_CHECK(cudaMemset(b.run.stats, 0, 2 * sizeof(unsigned long long)));
    launch();
    if (!check_kernel_error(b.run.err, what)) return false;
    unsigned long long st[2];
    CUDA_CHECK(cudaMemcpy(st, b.run.stats, sizeof st, cudaMemcpyDeviceToHost));
    *epi_us = st[1] ? (double)st[0] / (double)st[1] * 1e-3 : 0.0;
    return true;
}

/* An epilogue probe's run on its buffers b (epilogue_probe_buffers), whose modes are named
 * mode_names[0 .. modes) and run once by launch(mode, shape, iters):
 *   1. every mode on every test shape at iters 0 and 16, against the fp32 reference (probe_self_test);
 *      a failure ends the run there, since the timings of a wrong kernel mean nothing;
 *   2. the timing table: every forward shape at each of `iters`, each mode's median ms, TFLOP/s and
 *      its per-tile µs (`stat`: what the kernel's stats count), then the change of mode `against`
 *      from mode 0 (a kernel error fails the row).
 * Frees b, prints the closing `N passed, N failed` and returns the exit code. */
template <class Launch>
static int epilogue_probe_run(const ProbeBuffers &b, const char *const *mode_names, int modes,
                              std::initializer_list<int> iters, const char *stat, int against, Launch launch) {
    int passed = 0, failed = 0;
    /* PROBE_CASE=NAME (a forward shape's name) times that shape alone, PROBE_MODES=a,b those modes
       alone, with no self-test: for a profiler's run of kernels a whole run has checked */
    const char *only_case = getenv("PROBE_CASE"), *only_modes = getenv("PROBE_MODES");
    const auto timed = [&](int mode) {
        if (!only_modes) return true;
        const std::string list = std::string(",") + only_modes + ",";
        return list.find(std::string(",") + mode_names[mode] + ",") != std::string::npos;
    };
    if (only_case) printf("\nPROBE_CASE is set: no self-test, the timing of %s alone\n", only_case);
    for (const Shape &s : only_case ? std::vector<Shape>() : std::vector<Shape>(std::begin(EPILOGUE_TEST_SHAPES),
                                                                                 std::end(EPILOGUE_TEST_SHAPES))) {
        run_reference(b.dev, b.ref, s);
        for (int mode = 0; mode < modes; ++mode)
            for (int it : {0, 16}) {
                char what[96];
                snprintf(what, sizeof(what), "%s M %d N %d K %d iters %d", mode_names[mode], s.M, s.N, s.K, it);
                (probe_self_test(b, s, what, [&] { launch(mode, s, it); }) ? passed : failed)++;
            }
    }
    if (failed == 0) {
        printf("\ntiming: median of %d runs after %d warm-up runs; %s: mean per tile of one warpgroup\n", TIMED_RUNS,
               WARMUP_RUNS, stat);
        printf("%-16s %5s %5s %5s %5s |", "case", "M", "N", "K", "iters");
        for (int mode = 0; mode < modes; ++mode) printf(" %9s ms  TF/s %s |", mode_names[mode], stat);
        printf(" %s vs %s\n", mode_names[against], mode_names[0]);
        for (const NamedShape &t : FORWARD_SHAPES) {
            if (only_case && strcmp(only_case, t.name) != 0) continue;
            const double flops = 2.0 * t.s.M * t.s.N * t.s.K;
            for (int it : iters) {
                std::vector<double> ms(modes), us(modes);
                bool ok = true;
                for (int mode = 0; mode < modes; ++mode)
                    if (timed(mode))
                        ok = probe_time(b, mode_names[mode], [&] { launch(mode, t.s, it); }, &ms[mode], &us[mode]) && ok;
                (ok ? passed : failed)++;
                printf("%-16s %5d %5d %5d %5d |", t.name, t.s.M, t.s.N, t.s.K, it);
                for (int mode = 0; mode < modes; ++mode)
                    if (ms[mode] > 0.0) printf(" %12.3f %5.0f %6.2f |", ms[mode], flops / ms[mode] * 1e-9, us[mode]);
                    else printf(" %12s %5s %6s |", "-", "-", "-");
                if (ms[against] > 0.0 && ms[0] > 0.0) printf(" %+6.1f%%", 100.0 * (ms[against] - ms[0]) / ms[0]);
                printf("\n");
            }
        }
    }
    probe_buffers_free(b);
    printf("\n%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
