/* async_store_probe.cu — experiment: how much of a tile's epilogue do asynchronous (TMA) stores
 * take off the consumers of the cooperative 128 x 256 tile, beside the staged stores the library's
 * epilogues use?
 *
 * The question (docs/log.md): a compute task's epilogue runs with the SM's tensor cores idle, and
 * a ping-pong consumer, which would hide it behind the other warpgroup's main loop, loses more to
 * its narrower 128 x 128 tile than it hides (dev/pingpong_probe.cu). This keeps the 128 x 256
 * tile and its ring (3 stages of 48 KB, as the megakernel) and changes only how C leaves:
 *   staged    the consumers round C to bf16 into a padded 128 x 128 staging tile (stmatrix), sync,
 *             copy it out in 16-byte chunks, sync, twice (the pattern of the library's store_staged);
 *   tma       the consumers round C to bf16 into four 128-row x 64-column boxes in the 128B swizzle
 *             (64 KB), fence the async proxy and sync; consumer thread 0 issues four TMA tile stores
 *             and every consumer goes on to the next tile's main loop. Before the next epilogue
 *             writes the boxes, thread 0 waits until the stores have read them and the consumers
 *             sync (cp.async.bulk.wait_group.read);
 *   tma+wait  as tma, but thread 0 waits for the stores to complete (cp.async.bulk.wait_group 0)
 *             right after issuing them: what a task pays when the release of its done counter
 *             must follow its stores at once, instead of at its next epilogue.
 * Before the stores every mode runs the same synthetic epilogue math (`iters` passes of four FMA
 * chains over the thread's 128 accumulators, as pingpong_probe.cu), standing for the SwiGLU. Each
 * consumer warpgroup's thread 0 times its epilogues with %globaltimer (the tma modes' wait for the
 * boxes included). K-major A and B only: the forward's gate|up and down GEMMs.
 *
 * Build and run from the repository root (H100/H200):
 *   nvcc -std=c++17 -O3 -Isrc -gencode=arch=compute_90a,code=sm_90a -Xptxas -v dev/async_store_probe.cu \
 *        -o build/async_store_probe && ./build/async_store_probe [seed]
 * Every mode is first checked against the fp32 reference; it ends with `N passed, N failed`. */
#include "gemm_common.cuh"

#include "cuda/sm90/tile_operands.cuh" /* swizzle(): the 128B pattern of the boxes */

enum { MODE_STAGED = 0, MODE_TMA = 1, MODE_TMA_WAIT = 2, NUM_MODES = 3 };

struct StoreConfig : Coop256Config {
    static constexpr int STAGING_BYTES = BM * BN * 2;        /* four 16 KB boxes; staged uses 128 x 136 of it */
    static constexpr int STAGED_LD = 136;                    /* bf16 per padded staging row */
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + STAGING_BYTES + 2 * STAGES * 8 + SWIZZLE_ATOM_BYTES;
    static_assert(BM * STAGED_LD * 2 <= STAGING_BYTES, "the padded tile fits the staging region");
    static_assert(SMEM_BYTES <= 227 * 1024, "ring and staging fit in shared memory");
};

/* A warp's 16 rows from row0 of 8-column blocks j and j + 1 of the accumulators by one stmatrix:
 * matrix m is block j + m / 2, rows 8 (m % 2) ..; `addr(row, block)` is a row's 16 bytes. */
template <class Addr>
static __device__ __forceinline__ void stsm_blocks(const float (&acc)[128], int j, int row0, Addr addr) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    stsm_x4(addr(row0 + 8 * (m & 1) + (lane & 7), j + (m >> 1)), pack_bf16(acc[4 * j], acc[4 * j + 1]),
            pack_bf16(acc[4 * j + 2], acc[4 * j + 3]), pack_bf16(acc[4 * j + 4], acc[4 * j + 5]),
            pack_bf16(acc[4 * j + 6], acc[4 * j + 7]));
}

/* stats[0]: ns in epilogues (summed over warpgroups), stats[1]: epilogues timed. */
template <int MODE>
__global__ void __launch_bounds__(THREADS, 1)
    store_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 const __grid_constant__ CUtensorMap map_c, bf16 *__restrict__ C, int M, int N, int K, int iters,
                 unsigned long long *stats, float *sink, int *err) {
    using Cfg = StoreConfig;
    constexpr int STAGES = Cfg::STAGES;
    extern __shared__ uint8_t smem_raw[];
    const StagedSmem sm = staged_smem<Cfg>(smem_raw); /* staging: 1024-aligned, the boxes' swizzle */
    const uint32_t ring = sm.ring, staging = sm.staging, full_bar = sm.full_bar, empty_bar = sm.empty_bar;
    uint8_t *staging_ptr = sm.staging_ptr;

    const int num_m = (M + BM - 1) / BM, num_n = (N + Cfg::BN - 1) / Cfg::BN, num_k = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / WG_THREADS;
    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        prefetch_tensormap(&map_c);
    }
    ring_barriers_init<STAGES>(full_bar, empty_bar, 1);
    if (!consumer_role<Cfg>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err)) return;
    const int ctid = threadIdx.x - WG_THREADS, consumer = warpgroup - 1;
    const int row0 = (ctid >> 5) * 16; /* this warp's 16 rows of the tile */
    const uint64_t desc_a0 = make_smem_desc(ring + consumer * 64 * 128), desc_b0 = make_smem_desc(ring + Cfg::A_BYTES);
    float acc[128];
    RingCursor cur;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        if (!coop_k_loop<STAGES, Cfg::STAGE_BYTES, 128, 0, 0>(acc, cur, full_bar, empty_bar, desc_a0, desc_b0, 2, 2,
                                                              num_k, err))
            return;

        const uint64_t t0 = globaltimer_ns();
        /* the same 128 values as pingpong_probe.cu's: the first and second 64 of acc */
        busy_epilogue(*reinterpret_cast<const float(*)[64]>(acc), *reinterpret_cast<const float(*)[64]>(acc + 64), iters,
                      sink);
        if (MODE == MODE_STAGED) {
            store_c_staged<Cfg::STAGED_LD>(acc, staging, reinterpret_cast<const bf16 *>(staging_ptr), C, M, N, pos.m0,
                                           pos.n0);
        } else {
            if (ctid == 0) bulk_wait_read(); /* the last tile's stores have read the boxes */
            consumer_bar();
#pragma unroll
            for (int j = 0; j < 32; j += 2)
                stsm_blocks(acc, j, row0, [&](int r, int b) {
                    return staging + (b / 8) * (BM * 128) + swizzle(r, b % 8);
                });
            fence_proxy_async(); /* the generic-proxy writes, before the TMA unit reads them */
            consumer_bar();
            if (ctid == 0) {
                for (int b = 0; b < 4; ++b) tma_store_2d(&map_c, pos.n0 + 64 * b, pos.m0, staging + b * BM * 128);
                bulk_commit();
                if (MODE == MODE_TMA_WAIT) bulk_wait();
            }
        }
        if (threadIdx.x % WG_THREADS == 0) {
            atomicAdd(&stats[0], (unsigned long long)(globaltimer_ns() - t0));
            atomicAdd(&stats[1], 1ull);
        }
    }
    if (ctid == 0) bulk_wait(); /* every store done before the kernel ends */
}

/* ------------------------------------------------------------------------------------------ */
/* Host side.                                                                                 */

static const char *const mode_names[NUM_MODES] = {"staged", "tma", "tma+wait"};

template <int MODE>
static void launch(const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    const int grid = persistent_grid<StoreConfig, store_kernel<MODE>>(s);
    const CUtensorMap map_a = make_kmajor_map(o.A, s.M, s.K, BM, "A");
    const CUtensorMap map_b = make_kmajor_map(o.B, s.N, s.K, StoreConfig::BN, "B");
    const CUtensorMap map_c = make_kmajor_map(C, s.M, s.N, BM, "C"); /* boxes of 128 rows x 64 columns */
    store_kernel<MODE><<<grid, THREADS, StoreConfig::SMEM_BYTES>>>(map_a, map_b, map_c, C, s.M, s.N, s.K, iters,
                                                                  r.stats, r.sink, r.err);
    CUDA_CHECK(cudaGetLastError());
}

static void launch_mode(int mode, const Operands &o, bf16 *C, const Shape &s, int iters, const ProbeRun &r) {
    if (mode == MODE_STAGED) launch<MODE_STAGED>(o, C, s, iters, r);
    else if (mode == MODE_TMA) launch<MODE_TMA>(o, C, s, iters, r);
    else launch<MODE_TMA_WAIT>(o, C, s, iters, r);
}

int main(int argc, char **argv) {
    const ProbeBuffers buf = epilogue_probe_buffers(probe_start(argc, argv, StoreConfig::SMEM_BYTES));
    return epilogue_probe_run(buf, mode_names, NUM_MODES, {0, 16}, "epi µs", MODE_TMA,
                              [&](int mode, const Shape &s, int it) { launch_mode(mode, buf.ops, buf.C, s, it, buf.run); });
}
