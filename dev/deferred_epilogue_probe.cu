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

struct DeferConfig {
    static constexpr int BN = 256;
    static constexpr int STAGES = 3;
    static constexpr int A_BYTES = BM * BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + BN * BK * 2;
    static constexpr int GROUP_N = 2048 / BN;
    static constexpr int LD = BN + 8; /* bf16 per staging row: 528 bytes, so stmatrix's 8 rows hit other banks */
    static constexpr int STAGING_BYTES = BM * LD * 2;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGING_BYTES + 2 * STAGES * 8 + SWIZZLE_ATOM_BYTES;
    static constexpr int ROUNDS = 16; /* a warp's rows of the tile, one a round */
    static_assert(SMEM_BYTES <= 227 * 1024, "ring and staging fit in shared memory");
};

static __device__ __forceinline__ void consumer_bar() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
}

/* A warp's 16 rows from row0 of 8-column blocks j and j + 1 of the accumulators by one stmatrix
 * into a padded tile at `base` (row stride ld bf16; block j lands at block j - block0). */
static __device__ __forceinline__ void stsm_blocks(const float (&acc)[128], int j, uint32_t base, int ld, int row0,
                                                   int block0) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    const int r = row0 + 8 * (m & 1) + (lane & 7), b = j + (m >> 1) - block0;
    stsm_x4(base + r * (ld * 2) + b * 16, pack_bf16(acc[4 * j], acc[4 * j + 1]), pack_bf16(acc[4 * j + 2], acc[4 * j + 3]),
            pack_bf16(acc[4 * j + 4], acc[4 * j + 5]), pack_bf16(acc[4 * j + 6], acc[4 * j + 7]));
}

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

/* coop_k_loop (gemm_common.cuh) with a warp's deferred rounds run after each stage's commit and
 * before its wait: `per` rounds a stage while any are pending. */
template <int STAGES, int STAGE_BYTES>
static __device__ __forceinline__ bool k_loop_deferring(float (&acc)[128], RingCursor &cur, uint32_t full_bar,
                                                        uint32_t empty_bar, uint64_t desc_a0, uint64_t desc_b0, int num_k,
                                                        int *err, Pending &pend, int per, const bf16 *staging, int row0,
                                                        bf16 *C, int M, int N, int iters, float *sink) {
    const int lane = threadIdx.x % 32;
    for (int kb = 0; kb < num_k; ++kb) {
        if (!mbar_wait(full_bar + 8 * cur.stage, cur.phase, err, KERNEL_FULL_TIMEOUT)) {
            wgmma_wait<0>();
            return false;
        }
        __syncwarp();
        const uint64_t off = (uint64_t)((cur.stage * STAGE_BYTES) >> 4);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BK / 16; ++k)
            wgmma_tile<128, 0, 0>(acc, desc_a0 + off + 2 * k, desc_b0 + off + 2 * k, (kb | k) != 0);
        wgmma_commit();
        if (pend.done < DeferConfig::ROUNDS) /* warp-uniform */
            run_rounds(pend, min(pend.done + per, DeferConfig::ROUNDS), staging, row0, C, M, N, iters, sink);
        wgmma_wait<1>();
        if (kb > 0 && lane == 0) mbar_arrive(empty_bar + 8 * cur.prev);
        cur.prev = cur.stage;
        if (++cur.stage == STAGES) {
            cur.stage = 0;
            cur.phase ^= 1;
        }
    }
    wgmma_wait<0>();
    pin_accumulators(acc);
    if (lane == 0) mbar_arrive(empty_bar + 8 * cur.prev);
    return true;
}

/* stats[0]: ns between main loops (summed over warpgroups), stats[1]: tiles timed. */
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1)
    defer_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 bf16 *__restrict__ C, int M, int N, int K, int iters, unsigned long long *stats, float *sink, int *err) {
    using Cfg = DeferConfig;
    constexpr int STAGES = Cfg::STAGES;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t ring = (raw + SWIZZLE_ATOM_BYTES - 1) & ~(uint32_t)(SWIZZLE_ATOM_BYTES - 1);
    const uint32_t staging = ring + STAGES * Cfg::STAGE_BYTES;
    const uint32_t full_bar = staging + Cfg::STAGING_BYTES;
    const uint32_t empty_bar = full_bar + STAGES * 8;
    const bf16 *staging_ptr = reinterpret_cast<const bf16 *>(smem_raw + (staging - raw));

    const int num_m = (M + BM - 1) / BM, num_n = (N + Cfg::BN - 1) / Cfg::BN, num_k = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / WG_THREADS;
    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8 * s, 1);
            mbar_init(empty_bar + 8 * s, 8);
        }
        fence_barrier_init();
    }
    __syncthreads();
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0)
            produce_tiles<Cfg, 0, 0>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();
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
        else
            ok = k_loop_deferring<STAGES, Cfg::STAGE_BYTES>(acc, cur, full_bar, empty_bar, desc_a0, desc_b0, num_k, err,
                                                            pend, per, staging_ptr, row0, C, M, N, iters, sink);
        if (!ok) return;
        t_end = globaltimer_ns();
        if (MODE == MODE_STAGED) {
            busy_epilogue(*reinterpret_cast<const float(*)[64]>(acc), *reinterpret_cast<const float(*)[64]>(acc + 64),
                          iters, sink);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int j = 16 * h; j < 16 * h + 16; j += 2) stsm_blocks(acc, j, staging, Cfg::LD, row0, 16 * h);
                consumer_bar();
                for (int idx = ctid; idx < BM * 16; idx += 256) {
                    const int r = idx >> 4, c8 = (idx & 15) * 8, row = pos.m0 + r, col = pos.n0 + 128 * h + c8;
                    if (row < M && col < N)
                        *reinterpret_cast<int4 *>(C + (size_t)row * N + col) =
                            *reinterpret_cast<const int4 *>(staging_ptr + r * Cfg::LD + c8);
                }
                consumer_bar();
            }
        } else {
            /* the last tile's rounds are done (its loop ran them, or run them now), so the warp's
               rows of the staging tile are free */
            run_rounds(pend, Cfg::ROUNDS, staging_ptr, row0, C, M, N, iters, sink);
            __syncwarp();
#pragma unroll
            for (int j = 0; j < 32; j += 2) stsm_blocks(acc, j, staging, Cfg::LD, row0, 0);
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
    static bool attribute_set = false;
    if (!attribute_set) {
        CUDA_CHECK(cudaFuncSetAttribute(defer_kernel<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        DeferConfig::SMEM_BYTES));
        attribute_set = true;
    }
    const CUtensorMap map_a = make_kmajor_map(o.A, s.M, s.K, BM, "A");
    const CUtensorMap map_b = make_kmajor_map(o.B, s.N, s.K, DeferConfig::BN, "B");
    const long long tiles = (long long)((s.M + BM - 1) / BM) * ((s.N + DeferConfig::BN - 1) / DeferConfig::BN);
    const int grid = (int)std::min<long long>(tiles, g_num_sms);
    defer_kernel<MODE><<<grid, THREADS, DeferConfig::SMEM_BYTES>>>(map_a, map_b, C, s.M, s.N, s.K, iters, r.stats,
                                                                   r.sink, r.err);
    CUDA_CHECK(cudaGetLastError());
}

static void launch_mode(int mode, const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    if (mode == MODE_STAGED) launch<MODE_STAGED>(o, C, s, iters, r);
    else launch<MODE_DEFERRED>(o, C, s, iters, r);
}

static bool self_test(int mode, const ProbeBuffers &b, const Shape &s, int iters) {
    char what[96];
    snprintf(what, sizeof(what), "%s M %d N %d K %d iters %d", mode_names[mode], s.M, s.N, s.K, iters);
    return probe_self_test(b, s, what, [&] { launch_mode(mode, b.ops, b.C, s, iters, b.run); });
}

int main(int argc, char **argv) {
    CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    CHECK(prop.major == 9 && prop.minor == 0, "%s is sm_%d%d; this program is built for sm_90a only", prop.name,
          prop.major, prop.minor);
    CHECK((size_t)DeferConfig::SMEM_BYTES <= prop.sharedMemPerBlockOptin, "not enough shared memory per block (%zu)",
          prop.sharedMemPerBlockOptin);
    g_num_sms = prop.multiProcessorCount;
    load_driver_entry_points();
    const uint64_t seed = argc > 1 ? strtoull(argv[1], nullptr, 0) : (uint64_t)time(nullptr);
    printf("device %s, %d SMs, seed %llu\n", prop.name, g_num_sms, (unsigned long long)seed);

    /* self-test shapes: edges (M not a multiple of 128, N not of 256, K not of 64, one row, loops
       shorter than a tile's 16 rounds, more tiles than SMs so that the staging tile is reused) and
       one large */
    const Shape tests[] = {{1, 256, 64}, {77, 136, 72}, {300, 520, 1000}, {1000, 768, 2048}, {4096, 8192, 512},
                           {4096, 2048, 7168}};
    /* the forward's GEMMs of the benchmark's layers (routed rows: 16384) */
    struct Timed {
        const char *name;
        Shape s;
    } timed[] = {{"dsv3 gate|up", {16384, 4096, 7168}}, {"dsv3 down", {16384, 7168, 2048}},
                 {"qwen3 gate|up", {16384, 1536, 2048}}, {"qwen3 down", {16384, 2048, 768}},
                 {"mixtral gate|up", {16384, 28672, 4096}}, {"mixtral down", {16384, 4096, 14336}}};
    const int iters[] = {0, 16, 64};

    std::vector<Shape> shapes(std::begin(tests), std::end(tests));
    for (const Timed &t : timed) shapes.push_back(t.s);
    const ProbeBuffers buf = probe_buffers(shapes, seed);

    int passed = 0, failed = 0;
    printf("\nself-test against reference_gemm; pass: |err| <= %.0e + %.4f |ref|\n", ABS_TOL, REL_TOL);
    for (const Shape &s : tests) {
        run_reference(buf.dev, buf.ref, s);
        for (int mode = 0; mode < NUM_MODES; ++mode)
            for (int it : {0, 16}) (self_test(mode, buf, s, it) ? passed : failed)++;
    }
    if (failed) { /* timings of a wrong kernel mean nothing */
        printf("\n%d passed, %d failed\n", passed, failed);
        return 1;
    }

    printf("\ntiming: median of %d runs after %d warm-up runs; between µs: mean per tile, from one main loop's end "
           "to the next one's start, of one warpgroup\n",
           TIMED_RUNS, WARMUP_RUNS);
    printf("%-16s %5s %5s %5s %5s |", "case", "M", "N", "K", "iters");
    for (int mode = 0; mode < NUM_MODES; ++mode) printf(" %9s ms  TF/s between µs |", mode_names[mode]);
    printf(" deferred vs staged\n");
    for (const Timed &t : timed) {
        const double flops = 2.0 * t.s.M * t.s.N * t.s.K;
        for (int it : iters) {
            double ms[NUM_MODES], between[NUM_MODES];
            bool ok = true;
            for (int mode = 0; mode < NUM_MODES; ++mode)
                ok = probe_time(buf, mode_names[mode], [&] { launch_mode(mode, buf.ops, buf.C, t.s, it, buf.run); },
                                &ms[mode], &between[mode]) && ok;
            (ok ? passed : failed)++;
            printf("%-16s %5d %5d %5d %5d |", t.name, t.s.M, t.s.N, t.s.K, it);
            for (int mode = 0; mode < NUM_MODES; ++mode)
                printf(" %12.3f %5.0f %10.2f |", ms[mode], flops / ms[mode] * 1e-9, between[mode]);
            printf(" %+6.1f%%\n", 100.0 * (ms[MODE_DEFERRED] - ms[MODE_STAGED]) / ms[MODE_STAGED]);
        }
    }
    probe_buffers_free(buf);
    printf("\n%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
