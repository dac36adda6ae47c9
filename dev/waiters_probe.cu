/* waiters_probe.cu — experiment: what do threads that wait on mbarriers during the consumers'
 * main loops cost them?
 *
 * The question (docs/log.md): handing the epilogue to the producer warpgroup's spare warps made
 * long-K GEMMs 9-15% slower even with no epilogue math at all (epilogue_wg_probe.cu,
 * swiglu_handoff_probe.cu), a cost that grew with K, i.e. with the time those warps spend waiting
 * for the next tile. The megakernel's compute CTA has such waiters in every main loop: on the
 * TMA paths all 96 loader threads wait on each stage's empty barrier (thread 0 issues the loads,
 * the other 95 only arrive on the full barrier), and the completer (warp 3, lane 0) waits on the
 * done queue. Every mode runs the same cooperative 128 x 256 GEMM (the library's ring of 3 stages
 * of 48 KB, its tile order, registers 80 / 208 by setmaxnreg) with the staged epilogue
 * (store_c_staged, `iters` passes of synthetic math); they differ only in who waits:
 *   alone        thread 0 streams the stages (full barrier: 1 arrival), every other producer
 *                thread exits;
 *   completer    and warp 3's lane 0 waits for each finished tile (a barrier consumer thread 0
 *                arrives on after its epilogue), as the library's completer;
 *   idle3        and all of warps 1-3 wait for each finished tile, as the spare warps of a handoff;
 *   idle3-sleep  the same, backing off by __nanosleep between polls;
 *   loaders      warps 0-2 all wait on each stage's empty barrier; thread 0 loads, the other 95
 *                arrive on the full barrier (96 arrivals), as the library's TMA path;
 *   lib          loaders and completer, as the library;
 *   lib-sleep    the same, every producer-side wait backing off by __nanosleep;
 *   warp0        warp 0 alone waits on each stage's empty barrier, lane 0 loads and the other 31
 *                lanes arrive (32 arrivals), warps 1-3 exit: the library's TMA path with warps 1-2
 *                freed and warp 0 kept converged;
 *   warp0-one    the same, lane 0 arriving for all 32 lanes at once (the others only wait).
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a -Xptxas -v dev/waiters_probe.cu \
 *        -o build/waiters_probe && ./build/waiters_probe [seed]
 * Every mode is first checked against the fp32 reference; it ends with `N passed, N failed`. */
#include "gemm_common.cuh"

enum { ALONE, COMPLETER, IDLE3, IDLE3_SLEEP, LOADERS, LIB, LIB_SLEEP, WARP0, WARP0_ONE, NUM_MODES };
static const char *const mode_names[NUM_MODES] = {"alone", "completer", "idle3", "idle3-sleep", "loaders",
                                                  "lib", "lib-sleep", "warp0", "warp0-one"};

constexpr int WT_PRODUCER_REGS = 80, WT_CONSUMER_REGS = 208; /* the library's split */
constexpr int LOADERS_N = 96;                                /* warps 0-2 of the producer warpgroup */
constexpr unsigned BACKOFF_NS = 128;

struct WaitersConfig : Coop256Config {
    static constexpr int STAGED_LD = 136;
    static constexpr int STAGING_BYTES = BM * STAGED_LD * 2;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGING_BYTES + (2 * STAGES + 2) * 8 + SWIZZLE_ATOM_BYTES;
    static_assert(SMEM_BYTES <= 227 * 1024, "ring, staging tile and barriers fit in shared memory");
};

/* mbar_wait that sleeps between polls (SLEEP) or polls as mbar_wait does. */
template <bool SLEEP>
static __device__ __forceinline__ bool wait_on(uint32_t bar, uint32_t parity, int *err, int code) {
    if (!SLEEP) return mbar_wait(bar, parity, err, code);
    const uint64_t start = globaltimer_ns();
    for (uint32_t polls = 0;; ++polls) {
        if (mbar_try_wait(bar, parity)) return true;
        __nanosleep(BACKOFF_NS);
        if ((polls & 255) == 255) {
            if (*(volatile int *)err != KERNEL_OK) return false;
            if (globaltimer_ns() - start > (uint64_t)WAIT_TIMEOUT_NS) {
                atomicCAS(err, KERNEL_OK, code);
                return false;
            }
        }
    }
}

/* Every loader thread: wait for each stage's slot; thread 0 issues its loads, the others arrive on
 * its full barrier (one arrival each), or (ONE > 0) thread 0 arrives ONE times at once and the
 * others only wait. The same stages and order as produce_tiles. */
template <class Cfg, bool SLEEP, int ONE = 0>
static __device__ __forceinline__ void produce_tiles_wide(const CUtensorMap *map_a, const CUtensorMap *map_b,
                                                          uint32_t ring, uint32_t full_bar, uint32_t empty_bar,
                                                          int num_m, int num_n, int num_k, int *err) {
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        for (int kb = 0; kb < num_k; ++kb) {
            if (!wait_on<SLEEP>(empty_bar + 8 * stage, phase ^ 1, err, KERNEL_EMPTY_TIMEOUT)) return;
            const uint32_t dst = ring + stage * Cfg::STAGE_BYTES, full = full_bar + 8 * stage;
            if (threadIdx.x == 0) {
                if (ONE) { /* the expected bytes, then ONE arrivals at once */
                    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(full),
                                 "r"((uint32_t)Cfg::STAGE_BYTES)
                                 : "memory");
                    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(full), "r"((uint32_t)ONE)
                                 : "memory");
                } else {
                    mbar_arrive_expect_tx(full, Cfg::STAGE_BYTES);
                }
                tma_load_2d(dst, map_a, kb * BK, pos.m0, full);
                tma_load_2d(dst + Cfg::A_BYTES, map_b, kb * BK, pos.n0, full);
            } else if (!ONE) {
                mbar_arrive(full);
            }
            if (++stage == Cfg::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
}

/* stats[0]: ns in the consumers' epilogues (summed over warpgroups), stats[1]: epilogues timed. */
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1)
    waiters_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                   bf16 *__restrict__ C, int M, int N, int K, int iters, unsigned long long *stats, float *sink,
                   int *err) {
    using Cfg = WaitersConfig;
    constexpr bool WIDE = MODE == LOADERS || MODE == LIB || MODE == LIB_SLEEP;
    constexpr bool WARP = MODE == WARP0 || MODE == WARP0_ONE; /* warp 0 loads, converged */
    constexpr bool SLEEP = MODE == IDLE3_SLEEP || MODE == LIB_SLEEP;
    constexpr int WATCHERS = MODE == COMPLETER || MODE == LIB || MODE == LIB_SLEEP ? 1 : MODE == IDLE3 || MODE == IDLE3_SLEEP ? 96 : 0;
    extern __shared__ uint8_t smem_raw[];
    const StagedSmem sm = staged_smem<Cfg>(smem_raw);
    const uint32_t ring = sm.ring, staging = sm.staging, full_bar = sm.full_bar, empty_bar = sm.empty_bar;
    const uint32_t done = empty_bar + 8 * Cfg::STAGES, seen = done + 8;
    const bf16 *tile_ptr = reinterpret_cast<const bf16 *>(sm.staging_ptr);

    const int num_m = (M + BM - 1) / BM, num_n = (N + Cfg::BN - 1) / Cfg::BN, num_k = (K + BK - 1) / BK;
    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        mbar_init(done, 1);                        /* consumer thread 0, after each tile's epilogue */
        mbar_init(seen, WATCHERS ? WATCHERS : 1); /* every watcher, having seen it */
    }
    ring_barriers_init<Cfg::STAGES>(full_bar, empty_bar, WIDE ? LOADERS_N : WARP ? 32 : 1);

    if (threadIdx.x < WG_THREADS) {
        setmaxnreg_dec<WT_PRODUCER_REGS>();
        if (WIDE && threadIdx.x < LOADERS_N)
            produce_tiles_wide<Cfg, SLEEP>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        else if (WARP && threadIdx.x < 32)
            produce_tiles_wide<Cfg, false, MODE == WARP0_ONE ? 32 : 0>(&map_a, &map_b, ring, full_bar, empty_bar, num_m,
                                                                       num_n, num_k, err);
        else if (!WIDE && !WARP && threadIdx.x == 0)
            produce_tiles<Cfg, 0, 0>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        const bool watcher = WATCHERS == 1 ? threadIdx.x == 96 : WATCHERS == 96 && threadIdx.x >= 32;
        if (!watcher) return;
        int t = 0;
        for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x, ++t) {
            if (!wait_on<SLEEP>(done, t & 1, err, KERNEL_HANDOFF_TIMEOUT)) return;
            mbar_arrive(seen);
        }
        return;
    }

    setmaxnreg_inc<WT_CONSUMER_REGS>();
    const int ctid = threadIdx.x - WG_THREADS;
    consume_tiles<Cfg>(ring, full_bar, empty_bar, num_m, num_n, num_k, err, [&](float(&acc)[128], TilePos pos, int t) {
        const uint64_t t0 = globaltimer_ns();
        busy_epilogue(*reinterpret_cast<const float(*)[64]>(acc), *reinterpret_cast<const float(*)[64]>(acc + 64),
                      iters, sink);
        store_c_staged<Cfg::STAGED_LD>(acc, staging, tile_ptr, C, M, N, pos.m0, pos.n0);
        if (WATCHERS && ctid == 0) { /* the watchers saw the previous tile (a fresh barrier passes at once) */
            if (!mbar_wait(seen, (t & 1) ^ 1, err, KERNEL_HANDOFF_TIMEOUT)) return false;
            mbar_arrive(done);
        }
        if (threadIdx.x % WG_THREADS == 0) {
            atomicAdd(&stats[0], (unsigned long long)(globaltimer_ns() - t0));
            atomicAdd(&stats[1], 1ull);
        }
        return true;
    });
}

/* ------------------------------------------------------------------------------------------ */
/* Host side.                                                                                 */

template <int MODE>
static void launch(const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    launch_epilogue_probe<WaitersConfig, waiters_kernel<MODE>>(o, C, s, iters, r);
}

int main(int argc, char **argv) {
    const ProbeBuffers buf = epilogue_probe_buffers(probe_start(argc, argv, WaitersConfig::SMEM_BYTES));
    return epilogue_probe_run(buf, mode_names, NUM_MODES, {0}, "epi µs", LIB, [&](int mode, const Shape &s, int it) {
        switch (mode) {
        case ALONE: launch<ALONE>(buf.ops, buf.C, s, it, buf.run); break;
        case COMPLETER: launch<COMPLETER>(buf.ops, buf.C, s, it, buf.run); break;
        case IDLE3: launch<IDLE3>(buf.ops, buf.C, s, it, buf.run); break;
        case IDLE3_SLEEP: launch<IDLE3_SLEEP>(buf.ops, buf.C, s, it, buf.run); break;
        case LOADERS: launch<LOADERS>(buf.ops, buf.C, s, it, buf.run); break;
        case LIB: launch<LIB>(buf.ops, buf.C, s, it, buf.run); break;
        case LIB_SLEEP: launch<LIB_SLEEP>(buf.ops, buf.C, s, it, buf.run); break;
        case WARP0: launch<WARP0>(buf.ops, buf.C, s, it, buf.run); break;
        default: launch<WARP0_ONE>(buf.ops, buf.C, s, it, buf.run); break;
        }
    });
}
