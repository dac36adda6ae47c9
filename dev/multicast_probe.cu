/* multicast_probe.cu — experiment: do the cooperative 128 x 256 tile's main loops run faster when
 * two CTAs of a cluster share one operand, each loading half of it by TMA multicast into both?
 *
 * The question (docs/log.md): in the megakernel's forward the consumers wait on a stage's full
 * barrier more than on their wgmmas (Nsight Compute on Qwen3-30B-A3B, 16384 tokens: 16% of the
 * stall samples on the full-barrier wait, 10% on the wgmma waits and issues), the main loops run
 * at ~0.74 µs per 64-deep k-step where the tensor cores need ~0.56, and L2 is 72% busy over the
 * whole pass. Each k-step moves 48 KB from L2 into each SM (A 16 KB, B 32 KB) for 4.2 MFLOP:
 * at the tensor cores' rate, ~11 TB/s over 132 SMs. Two CTAs whose tiles share an operand can
 * each fetch half of it and multicast it into both CTAs' shared memory:
 *   solo    every CTA loads its own A and B (the library's tile);
 *   shareB  a cluster of two along M: the CTAs take row tiles m and m + 1 of the same 256
 *           columns, each loads its own A and 128 of the 256 rows of B, multicast to both
 *           (32 KB from L2 per CTA and k-step instead of 48: the megakernel's pairs would be
 *           two row tiles of one expert, sharing its weights);
 *   shareA  a cluster of two along N: column tiles n and n + 1 of the same 128 rows, each loads
 *           64 of A's 128 rows, multicast, and its own B (40 KB instead of 48);
 *   plain, coupled  controls: clusters of two walking shareB's pairs, each CTA loading its own A
 *           and B, its stages released by its own consumers (plain) or by both CTAs' (coupled).
 * A shared stage is refilled only when the consumers of both CTAs have released it: their warps
 * arrive on both CTAs' empty barriers (16 arrivals each). A CTA's full barrier expects the whole
 * stage, its own loads and the peer's multicast together. The number after a mode's name is its
 * ring's stages; a trailing c: the remote arrivals are releases at cluster scope instead of the
 * arrive's default (CTA scope, enough here: the wgmmas that read the stage have completed). The clusters walk pairs of tiles in the same
 * banded order as the solo tiles (gemm_common.cuh's tile_at, on the pair's shape); a pair's second
 * tile past M or N is computed from the zeros TMA fills in and not stored. Every mode has the
 * library's 3-stage ring and 128-column staging tile, and the same epilogue: the synthetic math
 * (`iters` passes, as pingpong_probe.cu) and the staged store. Each consumer warpgroup's thread 0
 * times its main loops (first full wait to last wgmma) with %globaltimer.
 * The grid: one CTA per SM (solo), or as many clusters as can be resident at once
 * (cudaOccupancyMaxActiveClusters; printed), since a cluster must fit in one GPC.
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a -Xptxas -v \
 *        dev/multicast_probe.cu -o build/multicast_probe && ./build/multicast_probe [seed]
 * Every mode is first checked against the fp32 reference; it ends with `N passed, N failed`. */
#include <type_traits>

#include "gemm_common.cuh"

enum { MODE_SOLO = 0, MODE_SHARE_B = 1, MODE_SHARE_A = 2, MODE_PAIR_PLAIN = 3, MODE_PAIR_COUPLED = 4 };
/* How a pair's consumers arrive on the empty barriers: a release at cluster scope, or the
 * arrive's default, a release at CTA scope. */
enum { ARRIVE_CLUSTER = 0, ARRIVE_CTA = 1 };
static __host__ __device__ constexpr bool pairs_along_m(int mode) { return mode == MODE_SHARE_B || mode >= MODE_PAIR_PLAIN; }
static __host__ __device__ constexpr bool released_by_both(int mode) {
    return mode == MODE_SHARE_B || mode == MODE_SHARE_A || mode == MODE_PAIR_COUPLED;
}

/* STAGES: 3, the library's ring (src/cuda/sm90/gemm_tile.cuh), or 4. Four 48 KB stages and the
 * staging tile leave no room for aligning the ring by hand: the dynamic shared memory starts
 * after the CTA's 1 KB reserved for the system, 1024-byte aligned (the kernel checks). */
template <int STAGES_>
struct McConfig {
    static constexpr int BN = 256;
    static constexpr int STAGES = STAGES_;
    static constexpr int A_BYTES = BM * BK * 2;
    static constexpr int B_BYTES = BN * BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int GROUP_N = 2048 / BN;
    static constexpr int LD = 128 + 8; /* the library's staging tile: 128 columns, padded */
    static constexpr int STAGING_BYTES = BM * LD * 2;
    static constexpr int SMEM_BYTES =
        STAGES * STAGE_BYTES + STAGING_BYTES + 2 * STAGES * 8 + (STAGES == 3 ? SWIZZLE_ATOM_BYTES : 0);
    static_assert(SMEM_BYTES <= 227 * 1024, "ring and staging fit in shared memory");
};
/* The order of shareA's pairs: tile_at on 512-column pairs, bands of 2048 columns as the others. */
struct PairAlongN {
    static constexpr int BN = 512;
    static constexpr int GROUP_N = 2048 / BN;
};

/* ---- clusters: the CTA's rank and index, the cluster barrier, a peer's shared memory ---------- */
static __device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
static __device__ __forceinline__ uint32_t cluster_index() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}
static __device__ __forceinline__ uint32_t cluster_count() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}
/* Every thread of both CTAs: what each did before (its remote arrivals too) is seen after. */
static __device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
/* The barrier at shared address `bar` of this CTA, in CTA `rank` of the cluster: one arrival. */
template <int ARRIVE>
static __device__ __forceinline__ void mbar_arrive_in(uint32_t bar, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
    if (ARRIVE == ARRIVE_CLUSTER)
        asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
    else
        asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
/* One box into shared address dst of every CTA in `mask`, completing its bytes on each one's
 * barrier at address bar. */
static __device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                                             uint32_t bar, uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}

/* A pair's consumer warp releases a stage in both CTAs (the peer's producer fills half of it). */
template <int ARRIVE>
struct PairRelease {
    __device__ __forceinline__ void operator()(uint32_t empty) const {
        mbar_arrive_in<ARRIVE>(empty, 0);
        mbar_arrive_in<ARRIVE>(empty, 1);
    }
};

/* Tile t of the CTA's walk (solo: tile t; pairs: pair t, this CTA's half of it). */
template <int MODE>
static __device__ __forceinline__ TilePos walk_pos(int t, int num_m2, int num_n2, uint32_t rank) {
    if (MODE == MODE_SOLO) return tile_at<McConfig<3>>(t, num_m2, num_n2);
    if (pairs_along_m(MODE)) {
        TilePos p = tile_at<McConfig<3>>(t, num_m2, num_n2); /* m0: the pair's index x BM */
        p.m0 = 2 * p.m0 + (int)rank * BM;
        return p;
    }
    TilePos p = tile_at<PairAlongN>(t, num_m2, num_n2);
    p.n0 += (int)rank * 256;
    return p;
}

/* stats[0]: ns in main loops (summed over warpgroups), stats[1]: main loops timed. */
template <int MODE, int STAGES_, int ARRIVE>
__global__ void __launch_bounds__(THREADS, 1)
    mc_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
              bf16 *__restrict__ C, int M, int N, int K, int iters, unsigned long long *stats, float *sink, int *err) {
    using Cfg = McConfig<STAGES_>;
    constexpr bool PAIR = MODE != MODE_SOLO;
    constexpr int STAGES = Cfg::STAGES;
    extern __shared__ uint8_t smem_raw[];
    const StagedSmem sm = staged_smem<Cfg>(smem_raw);
    if (STAGES != 3 && (smem_addr(smem_raw) & (SWIZZLE_ATOM_BYTES - 1))) { /* see McConfig */
        if (threadIdx.x == 0) atomicCAS(err, KERNEL_OK, KERNEL_SMEM_MISALIGNED);
        return;
    }
    const uint32_t ring = sm.ring, full_bar = sm.full_bar, empty_bar = sm.empty_bar;

    const int num_m = (M + BM - 1) / BM, num_n = (N + Cfg::BN - 1) / Cfg::BN, num_k = (K + BK - 1) / BK;
    const int num_m2 = pairs_along_m(MODE) ? (num_m + 1) / 2 : num_m;
    const int num_n2 = MODE == MODE_SHARE_A ? (num_n + 1) / 2 : num_n;
    const uint32_t rank = PAIR ? cluster_rank() : 0;
    const int group = PAIR ? (int)cluster_index() : (int)blockIdx.x;
    const int groups = PAIR ? (int)cluster_count() : (int)gridDim.x;
    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8 * s, 1);
            mbar_init(empty_bar + 8 * s, released_by_both(MODE) ? 16 : 8);
        }
        fence_barrier_init();
    }
    /* a pair: the peer's barriers are initialised before anything arrives on them */
    if (PAIR) cluster_sync();
    else __syncthreads();

    const int warpgroup = threadIdx.x / WG_THREADS;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            int stage = 0;
            uint32_t phase = 0;
            bool ok = true;
            for (int t = group; ok && t < num_m2 * num_n2; t += groups) {
                const TilePos pos = walk_pos<MODE>(t, num_m2, num_n2, rank);
                for (int kb = 0; kb < num_k; ++kb) {
                    if (!mbar_wait(empty_bar + 8 * stage, phase ^ 1, err, KERNEL_EMPTY_TIMEOUT)) {
                        ok = false;
                        break;
                    }
                    const uint32_t dst = ring + stage * Cfg::STAGE_BYTES, full = full_bar + 8 * stage;
                    mbar_arrive_expect_tx(full, Cfg::STAGE_BYTES); /* the peer's half included */
                    if (MODE == MODE_SHARE_A) /* rows m0 + 64 rank .. + 63 into both */
                        tma_load_2d_multicast(dst + rank * (Cfg::A_BYTES / 2), &map_a, kb * BK, pos.m0 + 64 * (int)rank,
                                              full, 3);
                    else
                        tma_load_2d(dst, &map_a, kb * BK, pos.m0, full);
                    if (MODE == MODE_SHARE_B) /* B rows n0 + 128 rank .. + 127 into both */
                        tma_load_2d_multicast(dst + Cfg::A_BYTES + rank * (Cfg::B_BYTES / 2), &map_b, kb * BK,
                                              pos.n0 + 128 * (int)rank, full, 3);
                    else
                        tma_load_2d(dst + Cfg::A_BYTES, &map_b, kb * BK, pos.n0, full);
                    if (++stage == STAGES) {
                        stage = 0;
                        phase ^= 1;
                    }
                }
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int consumer = warpgroup - 1;
        const uint64_t desc_a0 = make_smem_desc(ring + consumer * 64 * 128), desc_b0 = make_smem_desc(ring + Cfg::A_BYTES);
        const bf16 *staging_ptr = reinterpret_cast<const bf16 *>(sm.staging_ptr);
        float acc[128];
        RingCursor cur;
        for (int t = group; t < num_m2 * num_n2; t += groups) {
            const TilePos pos = walk_pos<MODE>(t, num_m2, num_n2, rank);
            const uint64_t t0 = globaltimer_ns();
            const bool ok = coop_k_loop<STAGES, Cfg::STAGE_BYTES, 128, 0, 0, false, NoHook,
                                        typename std::conditional<released_by_both(MODE), PairRelease<ARRIVE>, LocalRelease>::type>(
                acc, cur, full_bar, empty_bar, desc_a0, desc_b0, 2, 2, num_k, err);
            if (!ok) break;
            if (threadIdx.x % WG_THREADS == 0) {
                atomicAdd(&stats[0], (unsigned long long)(globaltimer_ns() - t0));
                atomicAdd(&stats[1], 1ull);
            }
            busy_epilogue(*reinterpret_cast<const float(*)[64]>(acc), *reinterpret_cast<const float(*)[64]>(acc + 64),
                          iters, sink);
            store_c_staged<Cfg::LD>(acc, sm.staging, staging_ptr, C, M, N, pos.m0, pos.n0);
        }
    }
    /* a pair: neither CTA leaves while the other may still write its shared memory or arrive on
       its barriers */
    __syncwarp();
    if (PAIR) cluster_sync();
}

/* ------------------------------------------------------------------------------------------ */
/* Host side.                                                                                 */

/* The probe's modes: (name, sharing, stages, arrive). */
struct ModeSpec {
    const char *name;
    int share, stages, arrive;
};
static const ModeSpec MODES[] = {{"solo3", MODE_SOLO, 3, ARRIVE_CTA},
                                 {"plain3", MODE_PAIR_PLAIN, 3, ARRIVE_CTA},
                                 {"coupled3c", MODE_PAIR_COUPLED, 3, ARRIVE_CLUSTER},
                                 {"coupled3", MODE_PAIR_COUPLED, 3, ARRIVE_CTA},
                                 {"shareB3c", MODE_SHARE_B, 3, ARRIVE_CLUSTER},
                                 {"shareB3", MODE_SHARE_B, 3, ARRIVE_CTA},
                                 {"shareA3", MODE_SHARE_A, 3, ARRIVE_CTA},
                                 {"shareB4", MODE_SHARE_B, 4, ARRIVE_CTA}};
constexpr int NUM_MODES = sizeof(MODES) / sizeof(MODES[0]);
static const char *mode_names[NUM_MODES];

template <int MODE, int STAGES, int ARRIVE = ARRIVE_CTA>
static void launch(const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    using Cfg = McConfig<STAGES>;
    constexpr bool PAIR = MODE != MODE_SOLO;
    static int max_groups = 0; /* CTAs (solo) or clusters resident at once */
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = PAIR ? 2 : 1;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = Cfg::SMEM_BYTES;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (!max_groups) {
        CUDA_CHECK(cudaFuncSetAttribute(mc_kernel<MODE, STAGES, ARRIVE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Cfg::SMEM_BYTES));
        if (PAIR) {
            cfg.gridDim = dim3(2 * (g_num_sms / 2));
            CUDA_CHECK(cudaOccupancyMaxActiveClusters(&max_groups, mc_kernel<MODE, STAGES, ARRIVE>, &cfg));
            printf("sharing %d, %d stages: %d clusters of 2 resident at once (%d SMs)\n", MODE, STAGES, max_groups,
                   g_num_sms);
            CHECK(max_groups > 0, "no cluster of 2 fits");
        } else {
            max_groups = g_num_sms;
        }
    }
    const int num_m = (s.M + BM - 1) / BM, num_n = (s.N + Cfg::BN - 1) / Cfg::BN;
    const long long units = pairs_along_m(MODE)   ? (long long)((num_m + 1) / 2) * num_n
                            : MODE == MODE_SHARE_A ? (long long)num_m * ((num_n + 1) / 2)
                                                   : (long long)num_m * num_n;
    const int groups = (int)std::min<long long>(units, max_groups);
    cfg.gridDim = dim3(PAIR ? 2 * groups : groups);
    const CUtensorMap map_a = make_kmajor_map(o.A, s.M, s.K, MODE == MODE_SHARE_A ? BM / 2 : BM, "A");
    const CUtensorMap map_b = make_kmajor_map(o.B, s.N, s.K, MODE == MODE_SHARE_B ? Cfg::BN / 2 : Cfg::BN, "B");
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, mc_kernel<MODE, STAGES, ARRIVE>, map_a, map_b, C, s.M, s.N, s.K, iters, r.stats, r.sink,
                                  r.err));
}

static void launch_mode(int mode, const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    const ModeSpec &m = MODES[mode];
    const bool cta = m.arrive == ARRIVE_CTA, three = m.stages == 3;
    if (m.share == MODE_SOLO) (three ? launch<MODE_SOLO, 3> : launch<MODE_SOLO, 4>)(o, C, s, iters, r);
    else if (m.share == MODE_PAIR_PLAIN) launch<MODE_PAIR_PLAIN, 3>(o, C, s, iters, r);
    else if (m.share == MODE_PAIR_COUPLED)
        (cta ? launch<MODE_PAIR_COUPLED, 3> : launch<MODE_PAIR_COUPLED, 3, ARRIVE_CLUSTER>)(o, C, s, iters, r);
    else if (m.share == MODE_SHARE_A) launch<MODE_SHARE_A, 3>(o, C, s, iters, r);
    else if (!cta) launch<MODE_SHARE_B, 3, ARRIVE_CLUSTER>(o, C, s, iters, r);
    else (three ? launch<MODE_SHARE_B, 3> : launch<MODE_SHARE_B, 4>)(o, C, s, iters, r);
}

int main(int argc, char **argv) {
    for (int m = 0; m < NUM_MODES; ++m) mode_names[m] = MODES[m].name;
    const ProbeBuffers buf = epilogue_probe_buffers(probe_start(argc, argv, McConfig<4>::SMEM_BYTES));
    return epilogue_probe_run(buf, mode_names, NUM_MODES, {0}, "loop µs", 5,
                              [&](int mode, const Shape &s, int it) { launch_mode(mode, buf.ops, buf.C, s, it, buf.run); });
}
