/* gather_probe.cu — experiment: can the gate|up tile read its activation rows straight from the
 * tokens' rows (a row gather by cp.async, or by one TMA box per row) instead of from rows a
 * dispatch copied into place (TMA), at the main loop's rate?
 *
 * The question (docs/log.md, design.md §6): on one rank the forward's dispatch only copies each
 * routed row's token row into expert order, so that the gate|up tiles can load A by TMA, which
 * reads boxes of consecutive rows. That copy takes comm CTAs away from the GEMMs (12 of 132 on
 * Qwen3-30B-A3B) and the compute CTAs wait on it where there are too few. A producer that gathers
 * A's rows itself, 16 bytes per cp.async into the 128B swizzle, needs no copy; B (the weights) stays
 * TMA. Modes, both on the cooperative 128 x 256 tile with a 3-stage ring of 48 KB (the library's):
 *   tma     A[M, K] = X[idx[m]] gathered by a kernel beforehand (the dispatch's output), one TMA box
 *           of 128 rows x 64 per stage, as the library loads it;
 *   gather  A's rows straight from X: each of the producer warpgroup's 128 threads issues 8 of the
 *           stage's 1024 16-byte cp.async (rows r = (t + 128 i) / 8, their source pointers read once
 *           per tile), then arrives on the stage's full barrier when they land
 *           (cp.async.mbarrier.arrive.noinc); thread 0 arms the same barrier with B's bytes and
 *           issues B's boxes first;
 *   rows    A's rows straight from X by TMA, one box of 1 row x 64 per row and stage (128 bytes,
 *           128B swizzle: the box lands at its row's place in the stage, where the swizzle is the
 *           row's), issued by the 32 lanes of warp 0 (4 rows each, their token rows read once per
 *           tile; rows past M read row T, past X's end, as zeros); lane 0 arms full[s] with the
 *           stage's bytes and issues B's box. 128 TMA instructions per stage against the
 *           gather's 1024 cp.async.
 * idx: for each of the M routed rows a random token of X [T, K], each token about M / T times, in
 * no order (as a dispatch's rows, grouped by expert, follow none).
 * The epilogue is the plain staged bf16 store of C (no synthetic work): the question is the main
 * loop's rate.
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a -Xptxas -v dev/gather_probe.cu \
 *        -o build/gather_probe && ./build/gather_probe [seed]
 * Both modes are first checked against the fp32 reference; it ends with `N passed, N failed`. */
#include "gemm_common.cuh"

#include "cuda/sm90/tile_operands.cuh" /* swizzle(): the 128B pattern */

enum { MODE_TMA = 0, MODE_GATHER = 1, MODE_ROWS = 2, NUM_MODES = 3 };

struct GatherConfig : Coop256Config {
    static constexpr int LD = 136; /* bf16 per staging row (128 columns, padded) */
    static constexpr int STAGING_BYTES = BM * LD * 2;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGING_BYTES + 2 * STAGES * 8 + SWIZZLE_ATOM_BYTES;
    static constexpr int CHUNKS = BM * BK / 8;                 /* 16-byte chunks of A per stage */
    static constexpr int PER_THREAD = CHUNKS / WG_THREADS;     /* the producer warpgroup's share */
    static_assert(CHUNKS % WG_THREADS == 0, "the producer threads share A's chunks evenly");
    static_assert(SMEM_BYTES <= 227 * 1024, "ring and staging fit in shared memory");
};
/* The library's split (gemm_tile.cuh): the gather's producers hold their chunks' token rows, and
 * spilled at gemm_common's 40 and at 56. */
constexpr int GATHER_PRODUCER_REGS = 80, GATHER_CONSUMER_REGS = 208;
static_assert(WG_THREADS * GATHER_PRODUCER_REGS + 2 * WG_THREADS * GATHER_CONSUMER_REGS <= 65536, "register split");

/* The gather producer (all 128 threads of warpgroup 0): per stage, thread 0 arms full[s] with B's
 * bytes and issues B's box; then every thread cp.asyncs its 8 chunks of A (rows past M as zeros)
 * and arrives on full[s] when they land. full[s] counts 1 + 128 arrivals. */
static __device__ __forceinline__ void produce_gather(const CUtensorMap *map_b, const bf16 *X, const int *idx,
                                                      uint32_t ring, uint32_t full_bar, uint32_t empty_bar, int M, int K,
                                                      int num_m, int num_n, int num_k, int *err) {
    using Cfg = GatherConfig;
    const int t = threadIdx.x;
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        int tok[Cfg::PER_THREAD]; /* the token row of each of the thread's chunks; -1 past M */
#pragma unroll
        for (int i = 0; i < Cfg::PER_THREAD; ++i) {
            const int row = pos.m0 + (t + WG_THREADS * i) / 8;
            tok[i] = row < M ? idx[row] : -1;
        }
        for (int kb = 0; kb < num_k; ++kb) {
            if (!mbar_wait(empty_bar + 8 * stage, phase ^ 1, err, KERNEL_EMPTY_TIMEOUT)) return;
            const uint32_t a_dst = ring + stage * Cfg::STAGE_BYTES, full = full_bar + 8 * stage;
            if (t == 0) {
                mbar_arrive_expect_tx(full, Cfg::BN * BK * 2);
                tma_load_2d(a_dst + Cfg::A_BYTES, map_b, kb * BK, pos.n0, full);
            }
#pragma unroll
            for (int i = 0; i < Cfg::PER_THREAD; ++i) {
                const int c = t + WG_THREADS * i, row = c / 8, chunk = c % 8;
                const int k = kb * BK + chunk * 8;
                const bool valid = tok[i] >= 0 && k < K;
                cp_async_16(a_dst + swizzle(row, chunk), valid ? X + (size_t)tok[i] * K + k : X, valid);
            }
            cp_async_arrive(full);
            if (++stage == Cfg::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
    cp_async_wait_all();
}

/* The rows producer (warp 0; NOTE in the header): per stage every lane issues the boxes of its 4
 * rows, lane 0 first arms full[s] with the whole stage's bytes (a box past X's end still delivers
 * its bytes, as zeros) and issues B's box. full[s] counts 1. */
static __device__ __forceinline__ void produce_rows(const CUtensorMap *map_x, const CUtensorMap *map_b, const int *idx,
                                                    uint32_t ring, uint32_t full_bar, uint32_t empty_bar, int M, int T,
                                                    int num_m, int num_n, int num_k, int *err) {
    using Cfg = GatherConfig;
    const int lane = threadIdx.x;
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        int tok[BM / 32];
#pragma unroll
        for (int j = 0; j < BM / 32; ++j) {
            const int row = pos.m0 + lane + 32 * j;
            tok[j] = row < M ? idx[row] : T;
        }
        for (int kb = 0; kb < num_k; ++kb) {
            if (!mbar_wait(empty_bar + 8 * stage, phase ^ 1, err, KERNEL_EMPTY_TIMEOUT)) return;
            __syncwarp();
            const uint32_t a_dst = ring + stage * Cfg::STAGE_BYTES, full = full_bar + 8 * stage;
            if (lane == 0) {
                mbar_arrive_expect_tx(full, Cfg::STAGE_BYTES);
                tma_load_2d(a_dst + Cfg::A_BYTES, map_b, kb * BK, pos.n0, full);
            }
#pragma unroll
            for (int j = 0; j < BM / 32; ++j) tma_load_2d(a_dst + (lane + 32 * j) * 128, map_x, kb * BK, tok[j], full);
            if (++stage == Cfg::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
}

template <int MODE>
__global__ void __launch_bounds__(THREADS, 1)
    gather_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                  const __grid_constant__ CUtensorMap map_x, const bf16 *__restrict__ X, const int *__restrict__ idx,
                  bf16 *__restrict__ C, int M, int N, int K, int T, int *err) {
    using Cfg = GatherConfig;
    constexpr int STAGES = Cfg::STAGES;
    extern __shared__ uint8_t smem_raw[];
    const StagedSmem sm = staged_smem<Cfg>(smem_raw);
    const uint32_t ring = sm.ring, staging = sm.staging, full_bar = sm.full_bar, empty_bar = sm.empty_bar;
    const bf16 *staging_ptr = reinterpret_cast<const bf16 *>(sm.staging_ptr);

    const int num_m = (M + BM - 1) / BM, num_n = (N + Cfg::BN - 1) / Cfg::BN, num_k = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / WG_THREADS;
    if (threadIdx.x == 0) {
        if (MODE == MODE_TMA) prefetch_tensormap(&map_a);
        if (MODE == MODE_ROWS) prefetch_tensormap(&map_x);
        prefetch_tensormap(&map_b);
    }
    ring_barriers_init<STAGES>(full_bar, empty_bar, MODE == MODE_GATHER ? 1 + WG_THREADS : 1);
    if (warpgroup == 0) {
        setmaxnreg_dec<GATHER_PRODUCER_REGS>();
        if (MODE == MODE_GATHER)
            produce_gather(&map_b, X, idx, ring, full_bar, empty_bar, M, K, num_m, num_n, num_k, err);
        else if (MODE == MODE_ROWS && threadIdx.x < 32)
            produce_rows(&map_x, &map_b, idx, ring, full_bar, empty_bar, M, T, num_m, num_n, num_k, err);
        else if (MODE == MODE_TMA && threadIdx.x == 0)
            produce_tiles<Cfg, 0, 0>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        return;
    }
    setmaxnreg_inc<GATHER_CONSUMER_REGS>();
    const int consumer = warpgroup - 1;
    const uint64_t desc_a0 = make_smem_desc(ring + consumer * 64 * 128), desc_b0 = make_smem_desc(ring + Cfg::A_BYTES);
    float acc[128];
    RingCursor cur;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        /* the gathered rows land through cp.async (the generic proxy): a fence before the wgmmas */
        const bool ok = coop_k_loop<STAGES, Cfg::STAGE_BYTES, 128, 0, 0, MODE == MODE_GATHER>(
            acc, cur, full_bar, empty_bar, desc_a0, desc_b0, 2, 2, num_k, err);
        if (!ok) return;
        store_c_staged<Cfg::LD>(acc, staging, staging_ptr, C, M, N, pos.m0, pos.n0);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Host side.                                                                                 */

static const char *const mode_names[NUM_MODES] = {"tma", "gather", "rows"};

/* Xg[m] = X[idx[m]]: the dispatch's output, for the TMA mode and the reference. */
__global__ void gather_rows(const bf16 *__restrict__ X, const int *__restrict__ idx, bf16 *__restrict__ Xg, int M, int K) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)M * K; i += (size_t)gridDim.x * blockDim.x)
        Xg[i] = X[(size_t)idx[i / K] * K + i % K];
}

/* A routing of M rows over T tokens (T <= M): every token about M / T times, in random order (a
 * dispatch's rows, grouped by expert, follow no token order). */
static std::vector<int> make_routing(int M, int T, uint64_t seed) {
    std::vector<int> idx(M);
    for (int m = 0; m < M; ++m) idx[m] = m % T;
    uint64_t z = seed | 1;
    for (int m = M - 1; m > 0; --m) { /* Fisher-Yates with xorshift64 */
        z ^= z << 13;
        z ^= z >> 7;
        z ^= z << 17;
        std::swap(idx[m], idx[(int)(z % (uint64_t)(m + 1))]);
    }
    return idx;
}

struct GatherBuffers {
    ProbeBuffers probe; /* dev.A holds X (T rows used), dev.At the gathered Xg; dev.B is B */
    int *idx;
};

template <int MODE>
static void launch(const GatherBuffers &g, const Shape &s, int tokens, int *err) {
    const int grid = persistent_grid<GatherConfig, gather_kernel<MODE>>(s);
    const CUtensorMap map_a = make_kmajor_map(g.probe.dev.At, s.M, s.K, BM, "Xg");
    const CUtensorMap map_b = make_kmajor_map(g.probe.dev.B, s.N, s.K, GatherConfig::BN, "B");
    const CUtensorMap map_x = make_kmajor_map(g.probe.dev.A, tokens, s.K, 1, "X rows");
    gather_kernel<MODE><<<grid, THREADS, GatherConfig::SMEM_BYTES>>>(map_a, map_b, map_x, g.probe.dev.A, g.idx,
                                                                     g.probe.C, s.M, s.N, s.K, tokens, err);
    CUDA_CHECK(cudaGetLastError());
}

static void launch_mode(int mode, const GatherBuffers &g, const Shape &s, int tokens) {
    if (mode == MODE_TMA) launch<MODE_TMA>(g, s, tokens, g.probe.run.err);
    else if (mode == MODE_GATHER) launch<MODE_GATHER>(g, s, tokens, g.probe.run.err);
    else launch<MODE_ROWS>(g, s, tokens, g.probe.run.err);
}

/* The routing for s into g.idx, Xg = X[idx] into dev.At, and the reference of Xg · B^T. */
static void prepare(const GatherBuffers &g, const Shape &s, int tokens, uint64_t seed) {
    const std::vector<int> idx = make_routing(s.M, tokens, seed);
    CUDA_CHECK(cudaMemcpy(g.idx, idx.data(), idx.size() * sizeof(int), cudaMemcpyHostToDevice));
    gather_rows<<<1024, 256>>>(g.probe.dev.A, g.idx, g.probe.dev.At, s.M, s.K);
    CUDA_CHECK(cudaGetLastError());
    const dim3 block(REF_BLOCK_N, REF_BLOCK_M);
    const dim3 grid((s.N + REF_BLOCK_N - 1) / REF_BLOCK_N, (s.M + REF_BLOCK_M - 1) / REF_BLOCK_M);
    reference_gemm<<<grid, block>>>(g.probe.dev.At, g.probe.dev.B, g.probe.ref, s.M, s.N, s.K);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
}

int main(int argc, char **argv) {
    const uint64_t seed = probe_start(argc, argv, GatherConfig::SMEM_BYTES);

    struct Case {
        const char *name;
        Shape s;
        int tokens; /* rows of X the routing draws from */
    };
    /* self-test shapes: edges (M not a multiple of 128, N not of 256, K not of 64, one row, more
       tiles than SMs) and one large; then the gate|up GEMMs of the benchmark's layers */
    const Case tests[] = {{"edge", {1, 256, 64}, 1},       {"edge", {77, 136, 72}, 40},
                          {"edge", {300, 520, 1000}, 37},  {"edge", {1000, 768, 2048}, 125},
                          {"many", {4096, 8192, 512}, 512}, {"large", {4096, 2048, 7168}, 512}};
    /* 16384 of the rows of an 8192-token batch (the benchmark's), X too large for L2 on the wide
       layers (DeepSeek-V3's 117 MB), as in the pass */
    const Case timed[] = {{"dsv3 gate|up", {16384, 4096, 7168}, 8192},
                          {"qwen3 gate|up", {16384, 1536, 2048}, 8192},
                          {"mixtral gate|up", {16384, 28672, 4096}, 8192}};

    std::vector<Shape> shapes;
    for (const Case &c : tests) shapes.push_back(c.s);
    for (const Case &c : timed) shapes.push_back(c.s);
    GatherBuffers g;
    g.probe = probe_buffers(shapes, seed);
    int max_m = 0;
    for (const Shape &s : shapes) max_m = std::max(max_m, s.M);
    CUDA_CHECK(cudaMalloc(&g.idx, (size_t)max_m * sizeof(int)));

    int passed = 0, failed = 0;
    printf("\nself-test against reference_gemm of the gathered rows; pass: |err| <= %.0e + %.4f |ref|\n", ABS_TOL,
           REL_TOL);
    for (const Case &c : tests) {
        prepare(g, c.s, c.tokens, seed);
        for (int mode = 0; mode < NUM_MODES; ++mode) {
            char what[96];
            snprintf(what, sizeof(what), "%s %s M %d N %d K %d T %d", mode_names[mode], c.name, c.s.M, c.s.N, c.s.K,
                     c.tokens);
            (probe_self_test(g.probe, c.s, what, [&] { launch_mode(mode, g, c.s, c.tokens); }) ? passed : failed)++;
        }
    }
    if (failed) { /* timings of a wrong kernel mean nothing */
        printf("\n%d passed, %d failed\n", passed, failed);
        return 1;
    }

    printf("\ntiming: median of %d runs after %d warm-up runs (the TMA mode's gather kernel, the dispatch's "
           "stand-in, not counted)\n",
           TIMED_RUNS, WARMUP_RUNS);
    printf("%-16s %5s %5s %5s %5s |", "case", "M", "N", "K", "T");
    for (int mode = 0; mode < NUM_MODES; ++mode) printf(" %7s ms  TF/s |", mode_names[mode]);
    printf(" gather, rows vs tma\n");
    for (const Case &c : timed) {
        prepare(g, c.s, c.tokens, seed);
        const double flops = 2.0 * c.s.M * c.s.N * c.s.K;
        double ms[NUM_MODES];
        bool ok = true;
        for (int mode = 0; mode < NUM_MODES; ++mode) {
            ms[mode] = time_median_ms([&] { launch_mode(mode, g, c.s, c.tokens); });
            ok = check_kernel_error(g.probe.run.err, mode_names[mode]) && ok;
        }
        (ok ? passed : failed)++;
        printf("%-16s %5d %5d %5d %5d |", c.name, c.s.M, c.s.N, c.s.K, c.tokens);
        for (int mode = 0; mode < NUM_MODES; ++mode) printf(" %10.3f %5.0f |", ms[mode], flops / ms[mode] * 1e-9);
        printf(" %+6.1f%% %+6.1f%%\n", 100.0 * (ms[MODE_GATHER] - ms[MODE_TMA]) / ms[MODE_TMA],
               100.0 * (ms[MODE_ROWS] - ms[MODE_TMA]) / ms[MODE_TMA]);
    }
    CUDA_CHECK(cudaFree(g.idx));
    probe_buffers_free(g.probe);
    printf("\n%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
