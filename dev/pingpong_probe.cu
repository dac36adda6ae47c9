/* pingpong_probe.cu — experiment: can a ping-pong consumer hide a long epilogue behind the
 * other warpgroup's main loop, and what does its narrower tile cost?
 *
 * The question (docs/log.md): the megakernel's compute tasks spend a good part of their time
 * (more in the backward than in the forward) outside the main loop, in epilogues run by
 * the same two consumer warpgroups that then run the next task's main loop, so the SM's tensor
 * cores idle through every epilogue (the producer's loads for the next task overlap it; the next
 * task's wgmmas do not). Two ways to run the 256 consumer threads:
 *   coop  both warpgroups on one 128 x 256 tile (64 rows each, m64n256k16), as the library does;
 *         they finish their main loops together and run their epilogues together;
 *   ping  each warpgroup on its own 128 x 128 tile (two m64n128k16 per k-step, rows 0..63 and
 *         64..127), the CTA's tiles dealt to the two in turn; a warpgroup starts its main loop
 *         when the other has issued its last one, so one's epilogue runs beside the other's main
 *         loop. Per FLOP it loads a third more operand bytes (B is 128 wide, not 256).
 * Both run the same synthetic epilogue on top of storing C: `iters` passes of four chained FMA
 * streams over the thread's 128 accumulators (the same work per output element in both modes:
 * each thread holds 128 of them), its result kept alive through a never-taken store. Each
 * warpgroup's thread 0 times its epilogues with %globaltimer; the program prints the mean µs per
 * tile epilogue next to each mode's TFLOP/s, on the layer shapes whose epilogues are long (dh, dx,
 * wgrad) and the forward's (gate|up, down).
 *
 * Protocol (ping):
 *   - The producer loads the CTA's tiles in order, num_k slices each, into one STAGES-deep ring
 *     (as coop). The CTA's i-th tile goes to warpgroup i % 2, which consumes slices
 *     i·num_k .. i·num_k + num_k - 1: stage = slot % STAGES, parity = (slot / STAGES) & 1.
 *   - empty[s] counts 4 arrivals (lane 0 of each warp of the one warpgroup that read the slot);
 *     coop's counts 8.
 *   - order[w] (count 4): the other warpgroup's warps arrive on it when they have issued their
 *     tile's last wgmma; warpgroup w waits on it before each of its tiles but the CTA's first.
 *     NOTE: this is what makes the full-barrier parities safe: a warpgroup waits for slot n only
 *     after the other one has waited for slot n - 1, so the stage of n has completed the phase of
 *     n - STAGES and not the one of n + STAGES (the producer cannot refill n's stage before n is
 *     released). Without it a warpgroup waiting ahead would see an older phase of the same
 *     parity. Each order[w] is at most one phase ahead of its waiter: the signaller's next
 *     signal follows a tile that waits for the waiter's own signal.
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a -Xptxas -v dev/pingpong_probe.cu \
 *        -o build/pingpong_probe && ./build/pingpong_probe [seed]
 * Every mode and layout is first checked against the fp32 reference (with and without the
 * synthetic epilogue, which must not change C); it ends with `N passed, N failed`. */
#include "gemm_common.cuh"

enum { MODE_COOP = 0, MODE_PING = 1 };

template <int MODE>
struct ProbeConfig {
    static constexpr int BN = MODE == MODE_COOP ? 256 : 128;  // columns of C per tile
    static constexpr int STAGES = MODE == MODE_COOP ? 4 : 6;  // both rings are 192 KB
    static constexpr int A_BYTES = BM * BK * 2;
    static constexpr int B_BYTES = BN * BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int GROUP_N = 2048 / BN;  // tile order: 2048-column bands (as gemm_wgmma_v1)
    static constexpr int EMPTY_ARRIVALS = MODE == MODE_COOP ? 8 : 4;
    // ring, full[], empty[], order[2]; +1024: the ring is aligned up to a swizzle atom by hand
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8 + 2 * 8 + SWIZZLE_ATOM_BYTES;
    static_assert(SMEM_BYTES <= 227 * 1024, "ring does not fit in shared memory");
};

/* Stores a 64-row block of m64nN accumulators (ACC = N / 2 per thread) as bf16: registers 4i+{0,1}
 * are row 16·warp + lane/4, columns 8i + 2·(lane%4) + {0,1}; 4i+{2,3} the same 8 rows down. */
template <int ACC>
static __device__ __forceinline__ void store_block(const float (&acc)[ACC], bf16 *C, int M, int N, int row0,
                                                   int col0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = row0 + 8 * half;
        if (row >= M) continue;
        bf16 *c_row = C + (size_t)row * N;
#pragma unroll
        for (int i = 0; i < ACC / 4; ++i) {
            const int col = col0 + 8 * i;
            if (col < N)
                *reinterpret_cast<__nv_bfloat162 *>(c_row + col) =
                    __floats2bfloat162_rn(acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]);
        }
    }
}

/* stats[0]: ns spent in epilogues (summed over warpgroups), stats[1]: epilogues timed. */
template <int MODE, int TA, int TB>
__global__ void __launch_bounds__(THREADS, 1)
    probe_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 bf16 *__restrict__ C, int M, int N, int K, int iters, unsigned long long *stats, float *sink,
                 int *err) {
    using Cfg = ProbeConfig<MODE>;
    constexpr int STAGES = Cfg::STAGES;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t ring = (raw + SWIZZLE_ATOM_BYTES - 1) & ~(uint32_t)(SWIZZLE_ATOM_BYTES - 1);
    const uint32_t full_bar = ring + STAGES * Cfg::STAGE_BYTES;
    const uint32_t empty_bar = full_bar + STAGES * 8;
    const uint32_t order_bar = empty_bar + STAGES * 8;  // [2]

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
            mbar_init(empty_bar + 8 * s, Cfg::EMPTY_ARRIVALS);
        }
        mbar_init(order_bar, 4);
        mbar_init(order_bar + 8, 4);
        fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) { /* producer: one thread, tiles of Cfg::BN columns */
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        produce_tiles<Cfg, TA, TB>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        return;
    }

    setmaxnreg_inc<CONSUMER_REGS>();
    const int consumer = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    constexpr uint64_t step_a = TA ? 2048 >> 4 : 2, step_b = TB ? 2048 >> 4 : 2;
    const uint64_t desc_b0 = TB ? make_smem_desc_mn(ring + Cfg::A_BYTES) : make_smem_desc(ring + Cfg::A_BYTES);
    /* the A rows a wgmma reads: coop, this warpgroup's 64; ping, 0..63 (lo) and 64..127 (hi) */
    auto desc_a_rows = [&](int h) { return TA ? make_smem_desc_mn(ring + h * 8192) : make_smem_desc(ring + h * 64 * 128); };

    if (MODE == MODE_COOP) {
        float acc[128];
        const uint64_t desc_a0 = desc_a_rows(consumer);
        RingCursor cur;
        for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
            const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
            if (!coop_k_loop<STAGES, Cfg::STAGE_BYTES, 128, TA, TB>(acc, cur, full_bar, empty_bar, desc_a0, desc_b0,
                                                                   step_a, step_b, num_k, err))
                return;
            const uint64_t t0 = globaltimer_ns();
            store_block<128>(acc, C, M, N, pos.m0 + consumer * 64 + warp * 16 + lane / 4, pos.n0 + 2 * (lane % 4));
            /* the same 128 values as ping's lo|hi: the first and second 64 of acc */
            busy_epilogue(*reinterpret_cast<const float(*)[64]>(acc), *reinterpret_cast<const float(*)[64]>(acc + 64),
                          iters, sink);
            if (threadIdx.x % WG_THREADS == 0) {
                atomicAdd(&stats[0], (unsigned long long)(globaltimer_ns() - t0));
                atomicAdd(&stats[1], 1ull);
            }
        }
        return;
    }

    /* ping: this warpgroup's tiles are the CTA's i-th for i % 2 == consumer */
    float lo[64], hi[64];
    const uint64_t desc_lo = desc_a_rows(0), desc_hi = desc_a_rows(1);
    uint32_t order_phase = 0;
    int i = 0;
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ++i) {
        if (i % 2 != consumer) continue;
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        if (i > 0) {
            if (!mbar_wait(order_bar + 8 * consumer, order_phase, err, KERNEL_ORDER_TIMEOUT)) return;
            order_phase ^= 1;
            __syncwarp();
        }
        int prev_stage = 0;
        for (int kb = 0; kb < num_k; ++kb) {
            const long long slot = (long long)i * num_k + kb;
            const int stage = (int)(slot % STAGES);
            const uint32_t phase = (uint32_t)((slot / STAGES) & 1);
            if (!mbar_wait(full_bar + 8 * stage, phase, err, KERNEL_FULL_TIMEOUT)) {
                wgmma_wait<0>();
                return;
            }
            __syncwarp();
            const uint64_t off = (uint64_t)((stage * Cfg::STAGE_BYTES) >> 4);
            wgmma_fence();
#pragma unroll
            for (int k = 0; k < BK / 16; ++k) {
                wgmma_m64n128k16<TA, TB>(lo, desc_lo + off + step_a * k, desc_b0 + off + step_b * k, (kb | k) != 0);
                wgmma_m64n128k16<TA, TB>(hi, desc_hi + off + step_a * k, desc_b0 + off + step_b * k, (kb | k) != 0);
            }
            wgmma_commit();
            wgmma_wait<1>();
            if (kb > 0 && lane == 0) mbar_arrive(empty_bar + 8 * prev_stage);
            prev_stage = stage;
        }
        /* every wgmma of the tile issued: the other warpgroup's turn */
        if (lane == 0) mbar_arrive(order_bar + 8 * (1 - consumer));
        wgmma_wait<0>();
        pin_accumulators(lo);
        pin_accumulators(hi);
        if (lane == 0) mbar_arrive(empty_bar + 8 * prev_stage);
        const uint64_t t0 = globaltimer_ns();
        const int col0 = pos.n0 + 2 * (lane % 4);
        store_block<64>(lo, C, M, N, pos.m0 + warp * 16 + lane / 4, col0);
        store_block<64>(hi, C, M, N, pos.m0 + 64 + warp * 16 + lane / 4, col0);
        busy_epilogue(lo, hi, iters, sink);
        if (threadIdx.x % WG_THREADS == 0) {
            atomicAdd(&stats[0], (unsigned long long)(globaltimer_ns() - t0));
            atomicAdd(&stats[1], 1ull);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Host side.                                                                                 */

template <int MODE, int TA, int TB>
static void launch_probe(const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    using Cfg = ProbeConfig<MODE>;
    static bool attribute_set = false;  // once per template instance
    if (!attribute_set) {
        CUDA_CHECK(cudaFuncSetAttribute(probe_kernel<MODE, TA, TB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Cfg::SMEM_BYTES));
        attribute_set = true;
    }
    const CUtensorMap map_a = TA ? make_mn_map(o.At, s.K, s.M, "At") : make_kmajor_map(o.A, s.M, s.K, BM, "A");
    const CUtensorMap map_b = TB ? make_mn_map(o.Bt, s.K, s.N, "Bt") : make_kmajor_map(o.B, s.N, s.K, Cfg::BN, "B");
    const long long tiles = (long long)((s.M + BM - 1) / BM) * ((s.N + Cfg::BN - 1) / Cfg::BN);
    const int grid = (int)std::min<long long>(tiles, g_num_sms);
    probe_kernel<MODE, TA, TB><<<grid, THREADS, Cfg::SMEM_BYTES>>>(map_a, map_b, C, s.M, s.N, s.K, iters, r.stats,
                                                                   r.sink, r.err);
    CUDA_CHECK(cudaGetLastError());
}

static const char *mode_name(int mode) { return mode == MODE_COOP ? "coop 128x256" : "ping 128x128"; }

template <int MODE, int TA, int TB>
static bool self_test(const ProbeBuffers &b, const Shape &s, int iters) {
    char what[112];
    snprintf(what, sizeof(what), "%s M %d N %d K %d %s%s iters %d", mode_name(MODE), s.M, s.N, s.K, TA ? "At" : "A",
             TB ? "Bt" : "B", iters);
    return probe_self_test(b, s, what, [&] { launch_probe<MODE, TA, TB>(b.ops, b.C, s, iters, b.run); });
}

/* Median ms of the mode on the shape, and the mean µs per tile epilogue over the timed runs. */
template <int MODE, int TA, int TB>
static bool time_one(const ProbeBuffers &b, const Shape &s, int iters, double *ms, double *epi_us) {
    return probe_time(b, mode_name(MODE), [&] { launch_probe<MODE, TA, TB>(b.ops, b.C, s, iters, b.run); }, ms,
                      epi_us);
}

struct Timed {
    const char *name;
    Shape s;
    int ta, tb;
};

template <int TA, int TB>
static bool time_case(const ProbeBuffers &b, const Timed &t, const int *iters, int n_iters) {
    const double flops = 2.0 * t.s.M * t.s.N * t.s.K;
    bool ok = true;
    for (int j = 0; j < n_iters; ++j) {
        double ms_c, ms_p, epi_c, epi_p;
        ok = time_one<MODE_COOP, TA, TB>(b, t.s, iters[j], &ms_c, &epi_c) && ok;
        ok = time_one<MODE_PING, TA, TB>(b, t.s, iters[j], &ms_p, &epi_p) && ok;
        printf("%-14s %5d %5d %5d %5d | %8.3f %6.1f %7.2f | %8.3f %6.1f %7.2f | %+6.1f%%\n", t.name, t.s.M, t.s.N, t.s.K,
               iters[j], ms_c, flops / ms_c * 1e-9, epi_c, ms_p, flops / ms_p * 1e-9, epi_p,
               100.0 * (ms_p - ms_c) / ms_c);
    }
    return ok;
}

int main(int argc, char **argv) {
    const uint64_t seed = probe_start(argc, argv,
                                      std::max<size_t>(ProbeConfig<MODE_COOP>::SMEM_BYTES, ProbeConfig<MODE_PING>::SMEM_BYTES));

    /* self-test shapes: edges (M not a multiple of 128, N not of the tile, K not of 64, one row,
       an odd number of tiles per CTA) and one large */
    const Shape tests[] = {{1, 256, 64}, {77, 136, 72}, {300, 520, 1000}, {1000, 768, 2048}, {4096, 2048, 7168}};
    /* the layers' GEMMs (DeepSeek-V3 and Qwen3-30B-A3B, 16384 routed rows; wgrad: one expert's
       2048 rows as K; Mixtral-8x7B's 8192 tokens x top-2) */
    const Timed timed[] = {
        {"dsv3 gate|up", {16384, 4096, 7168}, 0, 0}, {"dsv3 down", {16384, 7168, 2048}, 0, 0},
        {"dsv3 dh", {16384, 2048, 7168}, 0, 1},      {"dsv3 dx", {16384, 7168, 4096}, 0, 1},
        {"dsv3 wgrad", {2048, 7168, 2048}, 1, 1},    {"qwen3 dh", {16384, 768, 2048}, 0, 1},
        {"mixtral gate|up", {16384, 28672, 4096}, 0, 0}, {"mixtral down", {16384, 4096, 14336}, 0, 0},
    };
    const int iters[] = {0, 16, 64, 256};

    std::vector<Shape> shapes(std::begin(tests), std::end(tests));
    for (const Timed &t : timed) shapes.push_back(t.s);
    const ProbeBuffers buf = probe_buffers(shapes, seed);

    int passed = 0, failed = 0;
    printf("\nself-test against reference_gemm; pass: |err| <= %.0e + %.4f |ref|\n", ABS_TOL, REL_TOL);
    for (const Shape &s : tests) {
        run_reference(buf.dev, buf.ref, s);
        transpose_operands(buf.dev, s);
        for (int it : {0, 16}) {
            (self_test<MODE_COOP, 0, 0>(buf, s, it) ? passed : failed)++;
            (self_test<MODE_PING, 0, 0>(buf, s, it) ? passed : failed)++;
            (self_test<MODE_COOP, 0, 1>(buf, s, it) ? passed : failed)++;
            (self_test<MODE_PING, 0, 1>(buf, s, it) ? passed : failed)++;
            if (s.M % 8 == 0) { /* At's rows are M elements: TMA strides are multiples of 16 bytes */
                (self_test<MODE_COOP, 1, 1>(buf, s, it) ? passed : failed)++;
                (self_test<MODE_PING, 1, 1>(buf, s, it) ? passed : failed)++;
            }
        }
    }
    if (failed) { /* timings of a wrong kernel mean nothing */
        printf("\n%d passed, %d failed\n", passed, failed);
        return 1;
    }

    printf("\ntiming: median of %d runs after %d warm-up runs; epi µs: mean per tile epilogue (stores + "
           "synthetic work), one warpgroup's view\n",
           TIMED_RUNS, WARMUP_RUNS);
    printf("%-14s %5s %5s %5s %5s | %8s %6s %7s | %8s %6s %7s | %7s\n", "case", "M", "N", "K", "iters", "coop ms", "TF/s",
           "epi µs", "ping ms", "TF/s", "epi µs", "ping");
    for (const Timed &t : timed) {
        transpose_operands(buf.dev, t.s);
        bool ok;
        if (t.ta)
            ok = time_case<1, 1>(buf, t, iters, 4);
        else if (t.tb)
            ok = time_case<0, 1>(buf, t, iters, 4);
        else
            ok = time_case<0, 0>(buf, t, iters, 4);
        (ok ? passed : failed)++;
    }
    probe_buffers_free(buf);
    printf("\n%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
