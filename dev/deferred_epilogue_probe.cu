/* deferred_epilogue_probe.cu — experiment: does a tile's epilogue hide behind the next tile's main
 * loop when each warp runs it in slices between issuing a stage's wgmmas and waiting for them,
 * keeping the cooperative 128 x 256 tile?
 *
 * The question (docs/log.md): the epilogues of the forward's tiles run with the SM's tensor cores
 * idle (DeepSeek-V3 FP8: 12.4 µs of a 62 µs gate|up task, 5.2 of a 21 µs down task), a ping-pong
 * consumer loses more to its narrower tile than it hides (dev/pingpong_probe.cu), and TMA stores
 * take only the stores off the consumers (dev/async_store_probe.cu). A consumer warp waits on its
 * wgmmas for most of each stage: the epilogue's math and stores could use those cycles if they
 * did not need the accumulator registers, which the next tile's wgmmas own. So:
 *   staged    (the library's pattern) the synthetic epilogue math on the accumulators, then C
 *             rounded to bf16 into a padded staging tile (stmatrix), sync, copied out in 16-byte
 *             chunks, sync, twice (two 128-column halves);
 *   deferred  C rounded to bf16 into a padded 128 x 256 staging tile (each warp its own 16 rows:
 *             no barrier, a __syncwarp), and at once to the next tile's main loop. Each stage of
 *             that loop, after its wgmmas are committed and before the wait, the warp takes the
 *             next rounds of its 16 rows from the staging tile (a round: one row, 16 bytes a
 *             lane), runs the same synthetic math on them and stores them to C. A tile's rounds
 *             are spread over the next tile's stages (at least one a stage), and any left (the
 *             CTA's last tile, or a loop shorter than 16 stages) run after the loop.
 * Both modes do the same math per tile: `iters` x 128 FMAs per thread, in four chains (the
 * SwiGLU's stand-in, as in pingpong_probe.cu). Each consumer warpgroup's thread 0 times, with
 * %globaltimer, what its tiles spend between the end of one main loop and the start of the next.
 * What the megakernel would add is not modelled: a deferred tile's done counter would be bumped a
 * tile later, which matters only where a dependent task waits on it.
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a -Xptxas -v \
 *        dev/deferred_epilogue_probe.cu -o build/deferred_epilogue_probe && ./build/deferred_epilogue_probe [seed]
 * Both modes are first checked against the fp32 reference; it ends with `N passed, N failed`. */
#include "gemm_common.cuh"

enum { MODE_STAGED = 0, MODE_DEFERRED = 1, NUM_MODES = 2 };

struct DeferConfig : Coop256Config {
    static constexpr int LD = BN + 8; /* bf16 per staging row: 528 bytes, so stmatrix's 8 rows hit other banks */
    static constexpr int STAGING_BYTES = BM * LD * 2;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGING_BYTES + 2 * STAGES * 8 + SWIZZLE_ATOM_BYTES;
    static constexpr int ROUNDS = 16; /* a warp's rows of the tile, one a round */
    static_assert(SMEM_BYTES <= 227 * 1024, "ring and staging fit in shared memory");
};

/* The deferred work of one warp: the staged tile's rounds [done, until) (its rows row0 + round),
 * each lane's 8 values of the round through `iters` x 8 FMAs in four chains, then to C. */
struct Pending {
    int m0 = 0, n0 = 0, done = DeferConfig::ROUNDS; /* nothing pending */
};

static __device__ __forceinline__ void run_rounds(Pending &p, int until, const bf16 *staging, int row0, bf16 *C, int M,
                                                  int N, int iters, float *sink) {
    const int lane = threadIdx.x & 31;
    for (; p.done < until; ++p.done) {
        const int r = row0 + p.done, row = p.m0 + r, col = p.n0 + 8 * lane;
        const int4 v = *reinterpret_cast<const int4 *>(staging + r * DeferConfig::LD + 8 * lane);
        const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
        float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int it = 0; it < iters; ++it)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                x[i] = fmaf(__uint_as_float(w[i] << 16), x[i], 0.5f);
                x[i] = fmaf(__uint_as_float(w[i] & 0xFFFF0000u), x[i], 0.25f);
            }
        if (x[0] + x[1] + x[2] + x[3] == -12345.0f) *sink = x[0];
        if (row < M && col < N) *reinterpret_cast<int4 *>(C + (size_t)row * N + col) = v;
    }
}

/* stats[0]: ns between main loops (summed over warpgroups), stats[1]: tiles timed. */
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1)
    defer_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 bf16 *__restrict__ C, int M, int N, int K, int iters, unsigned long long *stats, float *sink, int *err) {
    using Cfg = DeferConfig;
    constexpr int STAGES = Cfg::STAGES;
    extern __shared__ uint8_t smem_raw[];
    const StagedSmem sm = staged_smem<Cfg>(smem_raw);
    const uint32_t ring = sm.ring, staging = sm.staging, full_bar = sm.full_bar, empty_bar = sm.empty_bar;
    const bf16 *staging_ptr = reinterpret_cast<const bf16 *>(sm.staging_ptr);

    const int num_m = (M + BM - 1) / BM, num_n = (N + Cfg::BN - 1) / Cfg::BN, num_k = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / WG_THREADS;
    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
    }
    ring_barriers_init<STAGES>(full_bar, empty_bar, 1);
    if (!consumer_role<Cfg>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err)) return;
    const int ctid = threadIdx.x - WG_THREADS, consumer = warpgroup - 1;
    const int row0 = (ctid >> 5) * 16; /* this warp's 16 rows of the tile */
    const uint64_t desc_a0 = make_smem_desc(ring + consumer * 64 * 128), desc_b0 = make_smem_desc(ring + Cfg::A_BYTES);
    const int per = (Cfg::ROUNDS + num_k - 1) / num_k; /* rounds a stage: all of them within one main loop */
    float acc[128];
    RingCursor cur;
    Pending pend;
    uint64_t t_end = 0; /* when the last main loop ended */
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        if (t_end && threadIdx.x % WG_THREADS == 0) {
            atomicAdd(&stats[0], (unsigned long long)(globaltimer_ns() - t_end));
            atomicAdd(&stats[1], 1ull);
        }
        bool ok;
        if (MODE == MODE_STAGED)
            ok = coop_k_loop<STAGES, Cfg::STAGE_BYTES, 128, 0, 0>(acc, cur, full_bar, empty_bar, desc_a0, desc_b0, 2, 2,
                                                                  num_k, err);
        else /* the last tile's rounds, `per` a stage, between each stage's commit and wait */
            ok = coop_k_loop<STAGES, Cfg::STAGE_BYTES, 128, 0, 0>(
                acc, cur, full_bar, empty_bar, desc_a0, desc_b0, 2, 2, num_k, err, [&] {
                    if (pend.done < Cfg::ROUNDS) /* warp-uniform */
                        run_rounds(pend, min(pend.done + per, Cfg::ROUNDS), staging_ptr, row0, C, M, N, iters, sink);
                });
        if (!ok) return;
        t_end = globaltimer_ns();
        if (MODE == MODE_STAGED) {
            busy_epilogue(*reinterpret_cast<const float(*)[64]>(acc), *reinterpret_cast<const float(*)[64]>(acc + 64),
                          iters, sink);
            store_c_staged<Cfg::LD>(acc, staging, staging_ptr, C, M, N, pos.m0, pos.n0);
        } else {
            /* the last tile's rounds are done (its loop ran them, or run them now), so the warp's
               rows of the staging tile are free */
            run_rounds(pend, Cfg::ROUNDS, staging_ptr, row0, C, M, N, iters, sink);
            __syncwarp();
#pragma unroll
            for (int j = 0; j < 32; j += 2) stsm_padded(acc, j, staging, Cfg::LD, row0, 0);
            __syncwarp(); /* the warp's stmatrix writes, before its lanes read other lanes' rows */
            pend.m0 = pos.m0;
            pend.n0 = pos.n0;
            pend.done = 0;
        }
    }
    if (MODE == MODE_DEFERRED) run_rounds(pend, Cfg::ROUNDS, staging_ptr, row0, C, M, N, iters, sink);
}

/* ------------------------------------------------------------------------------------------ */
/* Host side.                                                                                 */

static const char *const mode_names[NUM_MODES] = {"staged", "deferred"};

template <int MODE>
static void launch(const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    launch_epilogue_probe<DeferConfig, defer_kernel<MODE>>(o, C, s, iters, r);
}

static void launch_mode(int mode, const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    if (mode == MODE_STAGED) launch<MODE_STAGED>(o, C, s, iters, r);
    else launch<MODE_DEFERRED>(o, C, s, iters, r);
}

int main(int argc, char **argv) {
    const ProbeBuffers buf = epilogue_probe_buffers(probe_start(argc, argv, DeferConfig::SMEM_BYTES));
    return epilogue_probe_run(buf, mode_names, NUM_MODES, {0, 16, 64}, "between µs", MODE_DEFERRED,
                              [&](int mode, const Shape &s, int it) { launch_mode(mode, buf.ops, buf.C, s, it, buf.run); });
}
