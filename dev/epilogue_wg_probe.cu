/* epilogue_wg_probe.cu — experiment: do the producer warpgroup's idle warps, taking the tile's
 * epilogue off the consumers, hide it behind their next main loop, keeping the cooperative
 * 128 x 256 tile?
 *
 * The question (docs/log.md): a compute task's epilogue runs with the SM's tensor cores idle. A
 * ping-pong consumer loses more to its 128 x 128 tile's operand traffic than it hides
 * (pingpong_probe.cu), TMA stores take only the stores' ~1 µs off (async_store_probe.cu), and an
 * epilogue run in slices inside the next main loop spilled and slowed the loop
 * (deferred_epilogue_probe.cu). Left: hand the tile to other warps. A fourth warpgroup cannot
 * hold them: at 512 threads a thread gets at most 128 registers, fewer than an m64n256 wgmma's
 * accumulators need. The producer warpgroup's thread 0 issues every TMA load, so its warps 1-3
 * are free. Both modes run the same kernel (registers 80 / 208 a thread by setmaxnreg, as the
 * library), the library's ring (3 stages of 48 KB) and tile order:
 *   staged   the consumers run the synthetic epilogue math on their accumulators and store C
 *            through a padded 128 x 128 staging tile, twice (the library's store_staged); warps
 *            1-3 of the producer warpgroup idle;
 *   handoff  the consumers wait until the epilogue warps have read the previous tile, round C to
 *            bf16 into a padded 128 x 256 tile (stmatrix), arrive on `ready` and go on to the next
 *            tile's main loop; the 96 epilogue threads wait on `ready`, take 16-byte chunks of the
 *            tile (a warp's 32 chunks one row), run the same amount of math on them (one FMA an
 *            element a pass), store them, and arrive on `taken`.
 * `iters` passes of the synthetic math stand for the SwiGLU (0 and 16, as the other probes). Each
 * consumer warpgroup's thread 0 times its epilogue with %globaltimer: from its main loop's end to
 * the handoff's arrival (the wait for `taken` included), or to the staged stores' end.
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a -Xptxas -v dev/epilogue_wg_probe.cu \
 *        -o build/epilogue_wg_probe && ./build/epilogue_wg_probe [seed]
 * Every mode is first checked against the fp32 reference; it ends with `N passed, N failed`. */
#include "gemm_common.cuh"

enum { MODE_STAGED = 0, MODE_HANDOFF = 1, NUM_MODES = 2 };

constexpr int EPI_PRODUCER_REGS = 80, EPI_CONSUMER_REGS = 208; /* the producer warpgroup's with its epilogue warps */
constexpr int EPI_THREADS = WG_THREADS - 32;                     /* warps 1-3 of the producer warpgroup */
static_assert(WG_THREADS * EPI_PRODUCER_REGS + 2 * WG_THREADS * EPI_CONSUMER_REGS <= 65536,
              "the roles' registers fit the SM's");

struct HandoffConfig : Coop256Config {
    static constexpr int HANDOFF_LD = BN + 8;                /* bf16 a row of the handed-off tile */
    static constexpr int STAGED_LD = 136;                    /* bf16 a row of the staged mode's tile */
    static constexpr int STAGING_BYTES = BM * HANDOFF_LD * 2; /* the staged mode uses 128 x 136 of it */
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGING_BYTES + (2 * STAGES + 2) * 8 + SWIZZLE_ATOM_BYTES;
    static_assert(SMEM_BYTES <= 227 * 1024, "ring, handoff tile and barriers fit in shared memory");
};

/* An epilogue thread's share of the synthetic math: `iters` passes of one FMA an element over
 * its eight values, in eight chains; kept alive as busy_epilogue keeps its chains. */
static __device__ __forceinline__ void busy_chunk(const float (&v)[8], int iters, float (&x)[8]) {
    for (int it = 0; it < iters; ++it)
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = fmaf(v[k], x[k], (it & 1) ? 0.25f : 0.5f);
}

/* stats[0]: ns in the consumers' epilogues (summed over warpgroups), stats[1]: epilogues timed. */
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1)
    epilogue_wg_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                       bf16 *__restrict__ C, int M, int N, int K, int iters, unsigned long long *stats, float *sink,
                       int *err) {
    using Cfg = HandoffConfig;
    constexpr int STAGES = Cfg::STAGES, LD = Cfg::HANDOFF_LD;
    extern __shared__ uint8_t smem_raw[];
    const StagedSmem sm = staged_smem<Cfg>(smem_raw);
    const uint32_t ring = sm.ring, staging = sm.staging, full_bar = sm.full_bar, empty_bar = sm.empty_bar;
    const uint32_t ready = empty_bar + 8 * STAGES, taken = ready + 8;
    const bf16 *tile_ptr = reinterpret_cast<const bf16 *>(sm.staging_ptr);

    const int num_m = (M + BM - 1) / BM, num_n = (N + Cfg::BN - 1) / Cfg::BN, num_k = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / WG_THREADS;
    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        mbar_init(ready, 2 * WG_THREADS); /* every consumer thread, after its stmatrix */
        mbar_init(taken, EPI_THREADS);    /* every epilogue thread, after its reads */
    }
    ring_barriers_init<STAGES>(full_bar, empty_bar, 1); /* fences the inits and syncs the CTA */

    if (warpgroup == 0) { /* the producer (thread 0) and the epilogue warps (1-3) */
        setmaxnreg_dec<EPI_PRODUCER_REGS>();
        if (threadIdx.x == 0) produce_tiles<Cfg, 0, 0>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        if (MODE != MODE_HANDOFF || threadIdx.x < 32) return;
        const int etid = threadIdx.x - 32;
        float x[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int t = 0;
        for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x, ++t) {
            const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
            if (!mbar_wait(ready, t & 1, err, KERNEL_HANDOFF_TIMEOUT)) return;
#pragma unroll 4
            for (int idx = etid; idx < BM * (Cfg::BN / 8); idx += EPI_THREADS) { /* a warp's 32 chunks: one row */
                const int r = idx >> 5, c8 = (idx & 31) * 8;
                const int4 v = *reinterpret_cast<const int4 *>(tile_ptr + r * LD + c8);
                if (iters) {
                    const __nv_bfloat162 *p = reinterpret_cast<const __nv_bfloat162 *>(&v);
                    float f[8];
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const float2 q = __bfloat1622float2(p[k]);
                        f[2 * k] = q.x;
                        f[2 * k + 1] = q.y;
                    }
                    busy_chunk(f, iters, x);
                }
                const int row = pos.m0 + r, col = pos.n0 + c8;
                if (row < M && col < N) *reinterpret_cast<int4 *>(C + (size_t)row * N + col) = v;
            }
            mbar_arrive(taken);
        }
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) s += x[k];
        if (s == -12345.0f) *sink = s;
        return;
    }

    /* the consumers */
    setmaxnreg_inc<EPI_CONSUMER_REGS>();
    const int ctid = threadIdx.x - WG_THREADS, row0 = (ctid >> 5) * 16;
    consume_tiles<Cfg>(ring, full_bar, empty_bar, num_m, num_n, num_k, err, [&](float(&acc)[128], TilePos pos, int t) {
        const uint64_t t0 = globaltimer_ns();
        if (MODE == MODE_STAGED) {
            busy_epilogue(*reinterpret_cast<const float(*)[64]>(acc), *reinterpret_cast<const float(*)[64]>(acc + 64),
                          iters, sink);
            store_c_staged<Cfg::STAGED_LD>(acc, staging, tile_ptr, C, M, N, pos.m0, pos.n0);
        } else {
            /* the epilogue warps have read the previous tile (a fresh barrier passes at once) */
            if (!mbar_wait(taken, (t & 1) ^ 1, err, KERNEL_HANDOFF_TIMEOUT)) return false;
#pragma unroll
            for (int j = 0; j < 32; j += 2) stsm_padded(acc, j, staging, LD, row0, 0);
            mbar_arrive(ready); /* releases this thread's stmatrix writes to the epilogue warps */
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

static const char *const mode_names[NUM_MODES] = {"staged", "handoff"};

template <int MODE>
static void launch(const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    launch_epilogue_probe<HandoffConfig, epilogue_wg_kernel<MODE>>(o, C, s, iters, r);
}

int main(int argc, char **argv) {
    const ProbeBuffers buf = epilogue_probe_buffers(probe_start(argc, argv, HandoffConfig::SMEM_BYTES));
    return epilogue_probe_run(buf, mode_names, NUM_MODES, {0, 16}, "epi µs", MODE_HANDOFF,
                              [&](int mode, const Shape &s, int it) {
                                  if (mode == MODE_STAGED) launch<MODE_STAGED>(buf.ops, buf.C, s, it, buf.run);
                                  else launch<MODE_HANDOFF>(buf.ops, buf.C, s, it, buf.run);
                              });
}
