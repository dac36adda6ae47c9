/* gemm_wgmma_v1.cu — experiment: a persistent bf16 GEMM tile on Hopper built from TMA + wgmma,
 * C[M, N] = A[M, K] · B[N, K]^T (both operands K-major, fp32 accumulate, bf16 out), the
 * standalone form of the library's tile (src/cuda/sm90/gemm_tile.cuh), where its variants are tried.
 *
 * The one idea: warp specialisation over a shared-memory ring. One producer warpgroup (one
 * thread) streams 64-wide K slices of A and B into a STAGES-deep ring with TMA; two consumer
 * warpgroups each own 64 rows of the 128 x BN output tile and run wgmma straight from the
 * 128-byte-swizzled shared tiles. `full[s]` says slice s has landed (TMA byte count), `empty[s]`
 * says every consumer warp is done reading it. One CTA per SM walks many output tiles, so the
 * producer is already loading tile t+1 while the consumers run the epilogue of tile t.
 *
 * Build and run from the repository root (H100/H200, CUDA 12+; -DWITH_CUBLAS -lcublas adds the
 * cuBLAS baseline; mkdir -p build first):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -DWITH_CUBLAS \
 *        dev/gemm_wgmma_v1.cu -lcublas -o build/gemm_wgmma_v1 && ./build/gemm_wgmma_v1 [seed]
 * Without cuBLAS:
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a dev/gemm_wgmma_v1.cu \
 *        -o build/gemm_wgmma_v1 && ./build/gemm_wgmma_v1
 * It prints one line per self-test (shape, tile, max abs/rel error), then the timings, and
 * ends with `N passed, N failed`. Exit code 0 only if every self-test passed.
 *
 * Operand layouts (the backward's question: do transposed shared-memory operands cost?): besides
 * the K-major pair, B may be N-major (Bt[K, N], read with imm-trans-b, as dx and dh read the
 * weights) and A M-major (At[K, M], imm-trans-a, as the weight gradients read the activations).
 * The same reference checks every layout: Bt and At are transposed copies of B and A.
 *
 * Limits of v1: N % 8 == 0 and K % 8 == 0 (TMA row strides are multiples of 16 bytes, and C is
 * stored two columns at a time); any M >= 1. The epilogue stores straight from registers. */
#include "gemm_common.cuh"

template <int BN_>
struct TileConfig {
    static constexpr int BN = BN_;                            // columns of C per tile (wgmma N)
    static constexpr int STAGES = BN_ == 256 ? 4 : 6;         // both rings are 192 KB
    static constexpr int A_BYTES = BM * BK * 2;               // 16 KB
    static constexpr int B_BYTES = BN_ * BK * 2;              // 32 KB (BN 256) or 16 KB
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;     // what one full[] phase carries
    static constexpr int ACC = BN_ / 2;                       // fp32 accumulators per thread
    static constexpr int GROUP_N = 2048 / BN_;                // tile order: 2048-column bands
    // Ring, then the barriers; +1024 because the ring is aligned up to a swizzle atom by hand.
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8 + SWIZZLE_ATOM_BYTES;
    static_assert(BN_ == 128 || BN_ == 256, "wgmma N is 128 or 256 here");
    static_assert(A_BYTES % SWIZZLE_ATOM_BYTES == 0 && B_BYTES % SWIZZLE_ATOM_BYTES == 0,
                  "every operand tile must start on a swizzle atom (descriptor base offset 0)");
    static_assert(SMEM_BYTES <= 227 * 1024, "ring does not fit in shared memory");
};
/* ------------------------------------------------------------------------------------------ */
/* The kernel.                                                                                */

/* C[M, N] = A[M, K] · B[N, K]^T. grid = min(#SMs, #tiles), block = 384 threads, one CTA per SM.
 * NOTE (ring protocol): full[s] has count 1 (the producer's arrive.expect_tx) plus the TMA byte
 * count; empty[s] has count 8 (lane 0 of each of the 8 consumer warps, after its
 * wgmma.wait_group shows the wgmma that read slot s as complete). Both sides walk the slots in
 * the same order; the phase bit flips at each wrap, and the producer waits on empty with the
 * opposite parity, which a fresh barrier satisfies at once. */
template <int BN_, int TA, int TB>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                      bf16 *__restrict__ C, int M, int N, int K, int *err) {
    using Cfg = TileConfig<BN_>;
    constexpr int STAGES = Cfg::STAGES;
    constexpr int EMPTY_ARRIVALS = NUM_CONSUMERS * WG_THREADS / 32;

    extern __shared__ uint8_t smem_raw[];
    // The ring must start on a swizzle atom: TMA writes the 128B pattern by address bits and the
    // descriptors say base offset 0.
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t ring = (raw + SWIZZLE_ATOM_BYTES - 1) & ~(uint32_t)(SWIZZLE_ATOM_BYTES - 1);
    const uint32_t full_bar = ring + STAGES * Cfg::STAGE_BYTES;  // STAGES x 8 bytes
    const uint32_t empty_bar = full_bar + STAGES * 8;            // STAGES x 8 bytes

    const int num_m = (M + BM - 1) / BM;
    const int num_n = (N + Cfg::BN - 1) / Cfg::BN;
    const int num_tiles = num_m * num_n;
    const int num_k = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / WG_THREADS;

    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8 * s, 1);
            mbar_init(empty_bar + 8 * s, EMPTY_ARRIVALS);
        }
        fence_barrier_init();
    }
    // The last block-wide barrier: after the role split, warps leave at different times.
    __syncthreads();

    if (warpgroup == 0) {
        /* Producer: one thread issues every TMA; the other 127 only give their registers back. */
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        produce_tiles<Cfg, TA, TB>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        return;
    }

    /* Consumers: warpgroup 1 owns rows 0..63 of the tile, warpgroup 2 rows 64..127. */
    setmaxnreg_inc<CONSUMER_REGS>();
    const int consumer = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4;  // warp within the warpgroup: rows 16·warp..+15
    const int lane = threadIdx.x % 32;
    const uint64_t desc_a0 = TA ? make_smem_desc_mn(ring + consumer * 8192) : make_smem_desc(ring + consumer * 64 * 128);
    const uint64_t desc_b0 = TB ? make_smem_desc_mn(ring + Cfg::A_BYTES) : make_smem_desc(ring + Cfg::A_BYTES);
    /* 16 more k: +32 bytes along a K-major row, +2048 bytes (16 rows) in an MN-major operand */
    constexpr uint64_t step_a = TA ? 2048 >> 4 : 2, step_b = TB ? 2048 >> 4 : 2;

    float acc[Cfg::ACC];
    RingCursor cur;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        if (!coop_k_loop<STAGES, Cfg::STAGE_BYTES, Cfg::ACC, TA, TB>(acc, cur, full_bar, empty_bar, desc_a0, desc_b0,
                                                                    step_a, step_b, num_k, err))
            return;

        /* Epilogue. Accumulator layout (m64nN f32): registers 4i+{0,1} hold row 16·warp + lane/4,
         * columns 8i + 2·(lane%4) + {0,1}; registers 4i+{2,3} the same columns 8 rows down. */
        const int row0 = pos.m0 + consumer * 64 + warp * 16 + lane / 4;
        const int col0 = pos.n0 + 2 * (lane % 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + 8 * half;
            if (row >= M) continue;
            bf16 *c_row = C + (size_t)row * N;
#pragma unroll
            for (int i = 0; i < Cfg::ACC / 4; ++i) {
                const int col = col0 + 8 * i;
                if (col < N)  // N is even and col is even, so col + 1 < N too
                    *reinterpret_cast<__nv_bfloat162 *>(c_row + col) =
                        __floats2bfloat162_rn(acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]);
            }
        }
    }
}

/* Everything one GEMM launch needs, built once outside any timing loop. */
template <int BN, int TA, int TB>
struct GemmPlan {
    CUtensorMap map_a, map_b;
    bf16 *C;
    int M, N, K, grid;
};

template <int BN, int TA, int TB>
static GemmPlan<BN, TA, TB> make_plan(const Operands &o, bf16 *C, int M, int N, int K) {
    using Cfg = TileConfig<BN>;
    CHECK(M >= 1 && N >= 8 && K >= 8, "shape M %d N %d K %d: need M >= 1, N >= 8, K >= 8", M, N, K);
    CHECK(N % 8 == 0 && K % 8 == 0, "shape M %d N %d K %d: N and K must be multiples of 8", M, N, K);
    const long long tiles = (long long)((M + BM - 1) / BM) * ((N + BN - 1) / BN);
    CHECK(tiles < (1ll << 31), "too many tiles (%lld)", tiles);
    GemmPlan<BN, TA, TB> p;
    p.map_a = TA ? make_mn_map(o.At, K, M, "At") : make_kmajor_map(o.A, M, K, BM, "A");
    p.map_b = TB ? make_mn_map(o.Bt, K, N, "Bt") : make_kmajor_map(o.B, N, K, BN, "B");
    p.C = C;
    p.M = M;
    p.N = N;
    p.K = K;
    p.grid = (int)std::min<long long>(tiles, g_num_sms);
    static bool attribute_set = false;  // once per template instance
    if (!attribute_set) {
        CUDA_CHECK(cudaFuncSetAttribute(gemm_wgmma_kernel<BN, TA, TB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Cfg::SMEM_BYTES));
        attribute_set = true;
    }
    return p;
}

template <int BN, int TA, int TB>
static void launch(const GemmPlan<BN, TA, TB> &p, int *d_err) {
    gemm_wgmma_kernel<BN, TA, TB><<<p.grid, THREADS, TileConfig<BN>::SMEM_BYTES>>>(p.map_a, p.map_b, p.C, p.M, p.N, p.K,
                                                                           d_err);
    CUDA_CHECK(cudaGetLastError());
}

#ifdef WITH_CUBLAS
static const char *cublas_status_name(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "unknown cublasStatus_t";
    }
}
#define CUBLAS_CHECK(call)                                                                            \
    do {                                                                                              \
        cublasStatus_t st_ = (call);                                                                  \
        CHECK(st_ == CUBLAS_STATUS_SUCCESS, "%s failed: %s", #call, cublas_status_name(st_));         \
    } while (0)

/* C[M, N] row-major = A[M, K] · B[N, K]^T, said column-major: C^T[N, M] = op_T(B) · A^T. */
static void cublas_gemm(cublasHandle_t h, const bf16 *A, const bf16 *B, bf16 *C, int M, int N, int K) {
    const float alpha = 1.0f, beta = 0.0f;
    CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, B, CUDA_R_16BF, K, A, CUDA_R_16BF, K,
                              &beta, C, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
#endif
template <int BN, int TA, int TB>
static bool self_test_one(const Operands &o, bf16 *d_C, size_t c_capacity, const float *d_ref, const Shape &s,
                          int *d_err) {
    const size_t count = (size_t)s.M * s.N;
    const size_t guard = std::min<size_t>(c_capacity - count, 1 << 16);
    CUDA_CHECK(cudaMemset(d_C, 0xFF, (count + guard) * sizeof(bf16)));
    GemmPlan<BN, TA, TB> plan = make_plan<BN, TA, TB>(o, d_C, s.M, s.N, s.K);
    launch(plan, d_err);
    char what[96];
    snprintf(what, sizeof(what), "M %d N %d K %d tile 128x%d %s%s", s.M, s.N, s.K, BN, TA ? "At" : "A",
             TB ? "Bt" : "B");
    if (!check_kernel_error(d_err, what)) {
        printf("FAIL  %-36s kernel error (see stderr)\n", what);
        return false;
    }
    const CompareResult r = compare(d_C, d_ref, s.M, s.N, guard);
    const bool ok = r.bad == 0 && r.unwritten == 0 && r.guard_broken == 0;
    printf("%s  %-36s max abs %.3e  max rel %.3e  bad %zu  unwritten %zu  past-end %zu\n", ok ? "ok  " : "FAIL", what,
           r.max_abs, r.max_rel, r.bad, r.unwritten, r.guard_broken);
    return ok;
}

#ifdef WITH_CUBLAS
/* Largest |x - y| between two bf16 device buffers, and how many differ by more than the bf16
 * tolerance (used to check our result against cuBLAS on the timed shapes). */
static void compare_bf16(const bf16 *d_x, const bf16 *d_y, size_t count, double *max_abs, size_t *bad) {
    std::vector<uint16_t> x(count), y(count);
    CUDA_CHECK(cudaMemcpy(x.data(), d_x, count * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(y.data(), d_y, count * 2, cudaMemcpyDeviceToHost));
    *max_abs = 0.0;
    *bad = 0;
    for (size_t i = 0; i < count; ++i) {
        uint32_t bx = (uint32_t)x[i] << 16, by = (uint32_t)y[i] << 16;
        float fx, fy;
        memcpy(&fx, &bx, 4);
        memcpy(&fy, &by, 4);
        const double e = std::fabs((double)fx - (double)fy);
        if (std::isnan(e))
            *max_abs = INFINITY;
        else
            *max_abs = std::max(*max_abs, e);
        if (!(e <= ABS_TOL + 2 * REL_TOL * std::fabs((double)fy))) ++*bad;  // both sides rounded
    }
}
#endif

int main(int argc, char **argv) {
    int device = 0;
    CUDA_CHECK(cudaSetDevice(device));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    CHECK(prop.major == 9 && prop.minor == 0,
          "%s is sm_%d%d; this program is built for sm_90a (H100/H200) only", prop.name, prop.major, prop.minor);
    g_num_sms = prop.multiProcessorCount;
    CHECK((size_t)TileConfig<256>::SMEM_BYTES <= prop.sharedMemPerBlockOptin &&
              (size_t)TileConfig<128>::SMEM_BYTES <= prop.sharedMemPerBlockOptin,
          "need %d / %d bytes of shared memory per block, the device allows %zu", TileConfig<256>::SMEM_BYTES,
          TileConfig<128>::SMEM_BYTES, prop.sharedMemPerBlockOptin);
    load_driver_entry_points();

    const uint64_t seed = argc > 1 ? strtoull(argv[1], nullptr, 0) : (uint64_t)time(nullptr);
    printf("device %s, %d SMs; tile 128x256: %d stages, %d B smem; tile 128x128: %d stages, %d B smem; seed %llu\n",
           prop.name, g_num_sms, TileConfig<256>::STAGES, TileConfig<256>::SMEM_BYTES, TileConfig<128>::STAGES,
           TileConfig<128>::SMEM_BYTES, (unsigned long long)seed);

    // Self-test shapes: the requested grid, edges (M not a multiple of 128, N not a multiple of
    // the tile, K not a multiple of 64, a single row), and the second timed shape.
    std::vector<Shape> tests;
    for (int M : {128, 1000, 8192})
        for (int N : {256, 2048, 4096})
            for (int K : {768, 2048, 7168}) tests.push_back({M, N, K});
    tests.push_back({1, 256, 64});
    tests.push_back({77, 136, 72});
    tests.push_back({300, 520, 1000});
    tests.push_back({16384, 1536, 2048});
    /* square-ish, then the experts' own shapes: Qwen3-30B gate|up and down (16384 rows), DeepSeek-V3
       down (8192 rows) */
    const Shape timed[] = {{8192, 4096, 7168}, {16384, 1536, 2048}, {16384, 2048, 768}, {8192, 7168, 2048}};

    size_t a_elems = 0, b_elems = 0, c_elems = 0;
    std::vector<Shape> sized(tests);
    for (const Shape &s : timed) sized.push_back(s);
    for (const Shape &s : sized) {
        a_elems = std::max(a_elems, (size_t)s.M * s.K);
        b_elems = std::max(b_elems, (size_t)s.N * s.K);
        c_elems = std::max(c_elems, (size_t)s.M * s.N);
    }
    const size_t c_capacity = c_elems + (1 << 16);  // room for the past-the-end guard
    bf16 *d_C, *d_C2;
    float *d_ref;
    int *d_err;
    const DeviceOperands dev = alloc_operands(a_elems, b_elems, seed);
    const Operands ops = {dev.A, dev.B, dev.At, dev.Bt};
    CUDA_CHECK(cudaMalloc(&d_C, c_capacity * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&d_C2, c_elems * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&d_ref, c_elems * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&d_err, sizeof(int)));
    CUDA_CHECK(cudaMemset(d_err, 0, sizeof(int)));

    int passed = 0, failed = 0;
    printf("\nself-test against reference_gemm (fp32, one thread per output); pass: |err| <= %.0e + %.4f |ref|\n",
           ABS_TOL, REL_TOL);
    for (const Shape &s : tests) {
        run_reference(dev, d_ref, s);
        transpose_operands(dev, s);
        (self_test_one<256, 0, 0>(ops, d_C, c_capacity, d_ref, s, d_err) ? passed : failed)++;
        (self_test_one<128, 0, 0>(ops, d_C, c_capacity, d_ref, s, d_err) ? passed : failed)++;
        (self_test_one<256, 0, 1>(ops, d_C, c_capacity, d_ref, s, d_err) ? passed : failed)++;
        (self_test_one<128, 0, 1>(ops, d_C, c_capacity, d_ref, s, d_err) ? passed : failed)++;
        if (s.M % 8 == 0) { /* At's rows are M elements: TMA strides are multiples of 16 bytes */
            (self_test_one<256, 1, 1>(ops, d_C, c_capacity, d_ref, s, d_err) ? passed : failed)++;
            (self_test_one<128, 1, 1>(ops, d_C, c_capacity, d_ref, s, d_err) ? passed : failed)++;
        }
    }

    printf("\ntiming: median of %d runs after %d warm-up runs, CUDA events, same inputs each run\n", TIMED_RUNS,
           WARMUP_RUNS);
#ifdef WITH_CUBLAS
    cublasHandle_t handle;
    CUBLAS_CHECK(cublasCreate(&handle));
#endif
    for (const Shape &s : timed) {
        const double flops = 2.0 * s.M * s.N * s.K;
        transpose_operands(dev, s);
        GemmPlan<256, 0, 0> p256 = make_plan<256, 0, 0>(ops, d_C, s.M, s.N, s.K);
        GemmPlan<128, 0, 0> p128 = make_plan<128, 0, 0>(ops, d_C, s.M, s.N, s.K);
        const double ms256 = time_median_ms([&] { launch(p256, d_err); });
        bool ok = check_kernel_error(d_err, "timing 128x256");
        const double ms128 = time_median_ms([&] { launch(p128, d_err); });
        ok = check_kernel_error(d_err, "timing 128x128") && ok;
        /* the backward's layouts: B N-major (dx, dh), A M-major and B N-major (weight gradients) */
        GemmPlan<256, 0, 1> q256 = make_plan<256, 0, 1>(ops, d_C, s.M, s.N, s.K);
        GemmPlan<128, 0, 1> q128 = make_plan<128, 0, 1>(ops, d_C, s.M, s.N, s.K);
        GemmPlan<256, 1, 1> r256 = make_plan<256, 1, 1>(ops, d_C, s.M, s.N, s.K);
        GemmPlan<128, 1, 1> r128 = make_plan<128, 1, 1>(ops, d_C, s.M, s.N, s.K);
        const double qs256 = time_median_ms([&] { launch(q256, d_err); });
        const double qs128 = time_median_ms([&] { launch(q128, d_err); });
        const double rs256 = time_median_ms([&] { launch(r256, d_err); });
        const double rs128 = time_median_ms([&] { launch(r128, d_err); });
        ok = check_kernel_error(d_err, "timing transposed layouts") && ok;
        if (!ok) ++failed;
        printf("M %5d N %5d K %5d  wgmma 128x256: %8.3f ms %7.1f TFLOP/s   wgmma 128x128: %8.3f ms %7.1f TFLOP/s\n",
               s.M, s.N, s.K, ms256, flops / ms256 * 1e-9, ms128, flops / ms128 * 1e-9);
        printf("              A, Bt      128x256: %8.3f ms %7.1f TFLOP/s           128x128: %8.3f ms %7.1f TFLOP/s\n",
               qs256, flops / qs256 * 1e-9, qs128, flops / qs128 * 1e-9);
        printf("              At, Bt     128x256: %8.3f ms %7.1f TFLOP/s           128x128: %8.3f ms %7.1f TFLOP/s\n",
               rs256, flops / rs256 * 1e-9, rs128, flops / rs128 * 1e-9);
#ifdef WITH_CUBLAS
        const double ms_cublas = time_median_ms([&] { cublas_gemm(handle, dev.A, dev.B, d_C2, s.M, s.N, s.K); });
        CUDA_CHECK(cudaDeviceSynchronize());
        printf("                         cuBLAS:        %8.3f ms %7.1f TFLOP/s   (128x256 runs at %.0f%% of cuBLAS)\n",
               ms_cublas, flops / ms_cublas * 1e-9, 100.0 * ms_cublas / ms256);
        // d_C holds the result of the last 128x128 run: a cross-check of the cuBLAS call itself
        // (our tiles were checked against the reference above).
        double max_abs;
        size_t bad;
        compare_bf16(d_C, d_C2, (size_t)s.M * s.N, &max_abs, &bad);
        printf("                         vs cuBLAS: max abs diff %.3e, %zu elements beyond tolerance%s\n", max_abs, bad,
               bad ? "  (informational)" : "");
#endif
    }
#ifdef WITH_CUBLAS
    CUBLAS_CHECK(cublasDestroy(handle));
#else
    printf("(cuBLAS baseline not built: add -DWITH_CUBLAS ... -lcublas)\n");
#endif

    free_operands(dev);
    CUDA_CHECK(cudaFree(d_C));
    CUDA_CHECK(cudaFree(d_C2));
    CUDA_CHECK(cudaFree(d_ref));
    CUDA_CHECK(cudaFree(d_err));
    printf("\n%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
