/* swiglu_handoff_probe.cu — experiment: the forward's gate|up epilogue (the context g|u and
 * h = silu(g) · u out of a 128 x 256 tile) taken off the consumers by the producer warpgroup's
 * spare warps, in the forms the megakernel could use, against the consumers doing all of it.
 *
 * The question (docs/log.md): epilogue_wg_probe.cu showed three spare warps hiding a synthetic
 * epilogue behind the consumers' next main loop where they keep up. In the megakernel the
 * producer warpgroup's warps 1-2 could be freed on the TMA paths (warp 3 completes tasks), and
 * the real epilogue writes 96 KB a tile (g|u into the context, h into the ring) with a sigmoid an
 * element of h. Each tile's 256 columns are g (0-127) and u (128-255), as the library's gate|up
 * tile; C [M, N] is the context (g|u as bf16) and H [M, N / 2] the h rows. Modes:
 *   staged    the consumers do everything: h from their accumulators (core/portable.h's
 *             mok__swiglu, the library's rounding points), C and H through the padded staging
 *             tile in 16-byte chunks (the library's swiglu_staged);
 *   handoffN  the consumers round the tile to bf16 into a padded 128 x 256 tile and go on; N spare
 *             warps (2: warps 1-2, 3: warps 1-3) store g|u to C, compute h and store it to H;
 *   hybridN   the consumers round the tile into four 128B-swizzled boxes and their thread 0
 *             stores C from them by TMA; the N spare warps read g and u from the boxes, compute h
 *             and store H. Before the next tile the consumers wait for the warps' reads and for
 *             the TMA stores' reads of the boxes.
 * Each consumer warpgroup's thread 0 times its epilogue with %globaltimer (the handoff's waits
 * included).
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a -Xptxas -v dev/swiglu_handoff_probe.cu \
 *        -o build/swiglu_handoff_probe && ./build/swiglu_handoff_probe [seed]
 * Every mode is first checked: C against the fp32 reference, H against the host's SwiGLU of C's
 * g and u (within one bf16 rounding: the device's sigmoid divides by rcp.approx); it ends with
 * `N passed, N failed`. */
#include "gemm_common.cuh"

#include "core/portable.h"             /* mok__swiglu: the library's SwiGLU */
#include "cuda/sm90/tile_operands.cuh" /* swizzle(): the 128B pattern of the boxes */

enum { MODE_STAGED = 0, MODE_HANDOFF = 1, MODE_HYBRID = 2 };
constexpr int NUM_VARIANTS = 5; /* staged, handoff2, handoff3, hybrid2, hybrid3 */
static const char *const variant_names[NUM_VARIANTS] = {"staged", "handoff2", "handoff3", "hybrid2", "hybrid3"};

constexpr int SW_PRODUCER_REGS = 80, SW_CONSUMER_REGS = 208; /* the library's split */
static_assert(WG_THREADS * SW_PRODUCER_REGS + 2 * WG_THREADS * SW_CONSUMER_REGS <= 65536, "the roles' registers fit");

struct SwigluConfig : Coop256Config {
    static constexpr int HANDOFF_LD = BN + 8; /* bf16 a row of the padded handoff tile */
    static constexpr int STAGED_LD = 136;     /* bf16 a row of the staged mode's tile */
    static constexpr int BOX_BYTES = BM * 128; /* a 128-row x 64-column box */
    static constexpr int STAGING_BYTES = BM * HANDOFF_LD * 2; /* >= four boxes */
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGING_BYTES + (2 * STAGES + 2) * 8 + SWIZZLE_ATOM_BYTES;
    static_assert(4 * BOX_BYTES <= STAGING_BYTES, "the boxes fit the staging region");
    static_assert(SMEM_BYTES <= 227 * 1024, "ring, staging and barriers fit in shared memory");
};

static __device__ __forceinline__ float bf16_lo(uint32_t pair) { return __uint_as_float(pair << 16); }
static __device__ __forceinline__ float bf16_hi(uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }

/* h of eight g and u values (bf16 pairs), packed as four bf16 pairs */
static __device__ __forceinline__ int4 swiglu8(const int4 &g, const int4 &u) {
    const uint32_t *gp = reinterpret_cast<const uint32_t *>(&g), *up = reinterpret_cast<const uint32_t *>(&u);
    int4 h;
    uint32_t *hp = reinterpret_cast<uint32_t *>(&h);
#pragma unroll
    for (int k = 0; k < 4; ++k)
        hp[k] = pack_bf16(mok__swiglu(bf16_lo(gp[k]), bf16_lo(up[k]), 0.0f), mok__swiglu(bf16_hi(gp[k]), bf16_hi(up[k]), 0.0f));
    return h;
}

/* stats[0]: ns in the consumers' epilogues (summed over warpgroups), stats[1]: epilogues timed. */
template <int MODE, int WARPS>
__global__ void __launch_bounds__(THREADS, 1)
    swiglu_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                  const __grid_constant__ CUtensorMap map_c, bf16 *__restrict__ C, bf16 *__restrict__ H, int M, int N,
                  int K, unsigned long long *stats, int *err) {
    using Cfg = SwigluConfig;
    constexpr int STAGES = Cfg::STAGES, LD = Cfg::HANDOFF_LD, EPI = 32 * WARPS;
    extern __shared__ uint8_t smem_raw[];
    const StagedSmem sm = staged_smem<Cfg>(smem_raw); /* staging: 1024-aligned, the boxes' swizzle */
    const uint32_t ring = sm.ring, staging = sm.staging, full_bar = sm.full_bar, empty_bar = sm.empty_bar;
    const uint32_t ready = empty_bar + 8 * STAGES, taken = ready + 8;
    const uint8_t *tile = sm.staging_ptr;

    const int num_m = (M + BM - 1) / BM, num_n = (N + Cfg::BN - 1) / Cfg::BN, num_k = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / WG_THREADS, HN = N / 2;
    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        prefetch_tensormap(&map_c);
        mbar_init(ready, 2 * WG_THREADS); /* every consumer thread, after its stmatrix */
        mbar_init(taken, EPI);            /* every spare-warp thread, after its reads */
    }
    ring_barriers_init<STAGES>(full_bar, empty_bar, 1); /* fences the inits and syncs the CTA */

    if (warpgroup == 0) { /* the producer (thread 0) and the spare warps (1 .. WARPS) */
        setmaxnreg_dec<SW_PRODUCER_REGS>();
        if (threadIdx.x == 0) produce_tiles<Cfg, 0, 0>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        if (MODE == MODE_STAGED || threadIdx.x < 32 || threadIdx.x >= 32 + EPI) return;
        const int etid = threadIdx.x - 32;
        int t = 0;
        for (int tl = blockIdx.x; tl < num_m * num_n; tl += gridDim.x, ++t) {
            const TilePos pos = tile_at<Cfg>(tl, num_m, num_n);
            if (!mbar_wait(ready, t & 1, err, KERNEL_HANDOFF_TIMEOUT)) return;
            /* item: a row and 8 of its 128 h columns; a warp's 32 items are two rows */
            for (int idx = etid; idx < BM * 16; idx += EPI) {
                const int r = idx >> 4, c8 = (idx & 15) * 8;
                int4 g, u;
                if (MODE == MODE_HANDOFF) {
                    g = *reinterpret_cast<const int4 *>(tile + (r * LD + c8) * 2);
                    u = *reinterpret_cast<const int4 *>(tile + (r * LD + 128 + c8) * 2);
                } else { /* boxes 0-1 hold g, 2-3 u */
                    g = *reinterpret_cast<const int4 *>(tile + (c8 / 64) * Cfg::BOX_BYTES + swizzle(r, (c8 % 64) / 8));
                    u = *reinterpret_cast<const int4 *>(tile + (2 + c8 / 64) * Cfg::BOX_BYTES + swizzle(r, (c8 % 64) / 8));
                }
                const int row = pos.m0 + r;
                if (row < M) {
                    if (MODE == MODE_HANDOFF) {
                        *reinterpret_cast<int4 *>(C + (size_t)row * N + pos.n0 + c8) = g;
                        *reinterpret_cast<int4 *>(C + (size_t)row * N + pos.n0 + 128 + c8) = u;
                    }
                    *reinterpret_cast<int4 *>(H + (size_t)row * HN + pos.n0 / 2 + c8) = swiglu8(g, u);
                }
            }
            mbar_arrive(taken);
        }
        return;
    }

    /* the consumers */
    setmaxnreg_inc<SW_CONSUMER_REGS>();
    const int ctid = threadIdx.x - WG_THREADS, row0 = (ctid >> 5) * 16;
    consume_tiles<Cfg>(ring, full_bar, empty_bar, num_m, num_n, num_k, err, [&](float(&acc)[128], TilePos pos, int t) {
        const uint64_t t0 = globaltimer_ns();
        if (MODE == MODE_STAGED) {
            /* h of the thread's columns: g at accumulator block j, u at block j + 16 (as swiglu_staged) */
            uint32_t h[32];
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int a = 4 * j + 2 * half, b = 4 * (j + 16) + 2 * half;
                    const uint32_t g = pack_bf16(acc[a], acc[a + 1]), u = pack_bf16(acc[b], acc[b + 1]);
                    h[2 * j + half] = pack_bf16(mok__swiglu(bf16_lo(g), bf16_lo(u), 0.0f), mok__swiglu(bf16_hi(g), bf16_hi(u), 0.0f));
                }
            store_c_staged<Cfg::STAGED_LD>(acc, staging, reinterpret_cast<const bf16 *>(tile), C, M, N, pos.m0, pos.n0);
            const int lane = ctid & 31, m = lane >> 3;
#pragma unroll
            for (int j = 0; j < 16; j += 2) /* the h blocks j, j + 1 of the warp's 16 rows by one stmatrix */
                stsm_x4(staging + (row0 + 8 * (m & 1) + (lane & 7)) * (Cfg::STAGED_LD * 2) + (j + (m >> 1)) * 16,
                        h[2 * j], h[2 * j + 1], h[2 * j + 2], h[2 * j + 3]);
            consumer_bar();
            for (int idx = ctid; idx < BM * 16; idx += 2 * WG_THREADS) {
                const int r = idx >> 4, c8 = (idx & 15) * 8, row = pos.m0 + r;
                if (row < M)
                    *reinterpret_cast<int4 *>(H + (size_t)row * HN + pos.n0 / 2 + c8) =
                        *reinterpret_cast<const int4 *>(tile + (r * Cfg::STAGED_LD + c8) * 2);
            }
            consumer_bar();
        } else {
            /* the spare warps have read the previous tile (a fresh barrier passes at once) */
            if (!mbar_wait(taken, (t & 1) ^ 1, err, KERNEL_HANDOFF_TIMEOUT)) return false;
            if (MODE == MODE_HANDOFF) {
#pragma unroll
                for (int j = 0; j < 32; j += 2) stsm_padded(acc, j, staging, LD, row0, 0);
            } else {
                if (ctid == 0) bulk_wait_read(); /* the last tile's TMA stores have read the boxes */
                consumer_bar();
                const int lane = ctid & 31, m = lane >> 3, r = row0 + 8 * (m & 1) + (lane & 7);
#pragma unroll
                for (int j = 0; j < 32; j += 2) {
                    const int b = j + (m >> 1); /* 8-column block: box b / 8, chunk b % 8 */
                    stsm_x4(staging + (b / 8) * Cfg::BOX_BYTES + swizzle(r, b % 8), pack_bf16(acc[4 * j], acc[4 * j + 1]),
                            pack_bf16(acc[4 * j + 2], acc[4 * j + 3]), pack_bf16(acc[4 * j + 4], acc[4 * j + 5]),
                            pack_bf16(acc[4 * j + 6], acc[4 * j + 7]));
                }
                fence_proxy_async(); /* the generic-proxy writes, before the TMA unit reads them */
                consumer_bar();
                if (ctid == 0) {
                    for (int b = 0; b < 4; ++b) tma_store_2d(&map_c, pos.n0 + 64 * b, pos.m0, staging + b * Cfg::BOX_BYTES);
                    bulk_commit();
                }
            }
            mbar_arrive(ready); /* releases this thread's stmatrix writes to the spare warps */
        }
        if (threadIdx.x % WG_THREADS == 0) {
            atomicAdd(&stats[0], (unsigned long long)(globaltimer_ns() - t0));
            atomicAdd(&stats[1], 1ull);
        }
        return true;
    });
    if (MODE == MODE_HYBRID && ctid == 0) bulk_wait(); /* every store done before the kernel ends */
}

/* ------------------------------------------------------------------------------------------ */
/* Host side.                                                                                 */

struct Buffers {
    ProbeBuffers b;
    bf16 *H;
    size_t h_capacity;
};

static void launch(int variant, const Buffers &bufs, const Shape &s) {
    const Operands &o = bufs.b.ops;
    const CUtensorMap map_a = make_kmajor_map(o.A, s.M, s.K, BM, "A");
    const CUtensorMap map_b = make_kmajor_map(o.B, s.N, s.K, SwigluConfig::BN, "B");
    const CUtensorMap map_c = make_kmajor_map(bufs.b.C, s.M, s.N, BM, "C"); /* boxes of 128 rows x 64 columns */
    const ProbeRun &r = bufs.b.run;
#define SW_LAUNCH(MODE, WARPS)                                                                                        \
    swiglu_kernel<MODE, WARPS><<<persistent_grid<SwigluConfig, swiglu_kernel<MODE, WARPS>>(s), THREADS,              \
                                 SwigluConfig::SMEM_BYTES>>>(map_a, map_b, map_c, bufs.b.C, bufs.H, s.M, s.N, s.K, r.stats, \
                                                             r.err)
    switch (variant) {
    case 0: SW_LAUNCH(MODE_STAGED, 2); break;
    case 1: SW_LAUNCH(MODE_HANDOFF, 2); break;
    case 2: SW_LAUNCH(MODE_HANDOFF, 3); break;
    case 3: SW_LAUNCH(MODE_HYBRID, 2); break;
    default: SW_LAUNCH(MODE_HYBRID, 3); break;
    }
#undef SW_LAUNCH
    CUDA_CHECK(cudaGetLastError());
}

/* H against the host's SwiGLU of the written C's g and u: within one bf16 rounding of it. */
static size_t check_h(const Buffers &bufs, const Shape &s) {
    const size_t c = (size_t)s.M * s.N, h = c / 2;
    std::vector<uint16_t> gc(c), gh(h);
    CUDA_CHECK(cudaMemcpy(gc.data(), bufs.b.C, c * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gh.data(), bufs.H, h * 2, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (int r = 0; r < s.M; ++r)
        for (int j = 0; j < s.N / 2; ++j) {
            const int tile = j / 128, col = j % 128;
            const float g = mok__bf16_to_f32(gc[(size_t)r * s.N + 256 * tile + col]);
            const float u = mok__bf16_to_f32(gc[(size_t)r * s.N + 256 * tile + 128 + col]);
            const double want = mok__round_bf16(mok__swiglu(g, u, 0.0f));
            const double got = mok__bf16_to_f32(gh[(size_t)r * (s.N / 2) + j]);
            if (!(std::fabs(got - want) <= 1e-6 + std::fabs(want) / 128.0)) ++bad;
        }
    return bad;
}

int main(int argc, char **argv) {
    const uint64_t seed = probe_start(argc, argv, SwigluConfig::SMEM_BYTES);
    /* N a multiple of 256: every tile is g | u */
    const Shape tests[] = {{1, 256, 64}, {77, 512, 72}, {300, 768, 1000}, {1000, 1536, 2048}, {4096, 4096, 512}};
    const NamedShape timed[] = {{"dsv3 gate|up", {16384, 4096, 7168}},   {"qwen3 gate|up", {16384, 1536, 2048}},
                                {"mixtral gate|up", {16384, 28672, 4096}}, {"I 1024, H 4096", {16384, 2048, 4096}},
                                {"I 512, H 2048", {16384, 1024, 2048}}};
    std::vector<Shape> all(std::begin(tests), std::end(tests));
    for (const NamedShape &t : timed) all.push_back(t.s);
    Buffers bufs;
    bufs.b = probe_buffers(all, seed);
    size_t hmax = 0;
    for (const Shape &s : all) hmax = std::max(hmax, (size_t)s.M * s.N / 2);
    CUDA_CHECK(cudaMalloc(&bufs.H, hmax * 2));
    int passed = 0, failed = 0;
    printf("\nself-test: C against reference_gemm (|err| <= %.0e + %.4f |ref|), H against the host's SwiGLU of C\n",
           ABS_TOL, REL_TOL);
    for (const Shape &s : tests) {
        run_reference(bufs.b.dev, bufs.b.ref, s);
        for (int v = 0; v < NUM_VARIANTS; ++v) {
            char what[96];
            snprintf(what, sizeof what, "%s M %d N %d K %d", variant_names[v], s.M, s.N, s.K);
            CUDA_CHECK(cudaMemset(bufs.H, 0xFF, (size_t)s.M * s.N));
            const bool c_ok = probe_self_test(bufs.b, s, what, [&] { launch(v, bufs, s); });
            const size_t h_bad = c_ok ? check_h(bufs, s) : 1;
            if (c_ok && h_bad) printf("FAIL  %-56s H: %zu values off\n", what, h_bad);
            (c_ok && h_bad == 0 ? passed : failed)++;
        }
    }
    if (failed == 0) {
        printf("\ntiming: median of %d runs after %d warm-up runs; epi µs: the consumers' epilogue a tile\n", TIMED_RUNS,
               WARMUP_RUNS);
        printf("%-16s %5s %5s %5s |", "case", "M", "N", "K");
        for (int v = 0; v < NUM_VARIANTS; ++v) printf(" %9s ms epi µs |", variant_names[v]);
        printf("\n");
        for (const NamedShape &t : timed) {
            printf("%-16s %5d %5d %5d |", t.name, t.s.M, t.s.N, t.s.K);
            bool ok = true;
            for (int v = 0; v < NUM_VARIANTS; ++v) {
                double ms = 0, us = 0;
                ok = probe_time(bufs.b, variant_names[v], [&] { launch(v, bufs, t.s); }, &ms, &us) && ok;
                printf(" %12.3f %6.2f |", ms, us);
            }
            printf("\n");
            (ok ? passed : failed)++;
        }
    }
    CUDA_CHECK(cudaFree(bufs.H));
    probe_buffers_free(bufs.b);
    printf("\n%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
