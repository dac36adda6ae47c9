/* fp8_tile_probe.cu — experiment: the block-scaled FP8 GEMM tile for Hopper (sm_90a), the first
 * measured step of the megakernel's FP8 path. It computes
 *
 *   C[m, n] = sum over the 128-wide K blocks kb, in kb order, of
 *             acc = fma(partial_kb[m, n], sa[kb][m] * sb[kb][n / 128], acc)       (fp32, acc from 0)
 *   partial_kb[m, n] = sum over k in kb of qa[m, k] * qb[n, k]                     (the tensor cores)
 *
 * with qa [M, K] and qb [N, K] E4M3 codes (activations and weights, both K-major), sa one
 * power-of-two fp32 scale per row per 128 of K (1x128) and sb one per 128x128 weight block, stored
 * MN-major per K block (sa [K/128][round_up(M, 4)], sb [K/128][round_up(N/128, 4)]) so that one
 * TMA box brings a stage's scales. The output is bf16 (round to nearest even) or, for the checks,
 * the fp32 accumulators themselves; both row-major.
 *
 * The tile: persistent, one CTA per SM, 384 threads. One producer thread streams each 128-K block
 * of A and B (TMA, 128B swizzle: a 128-byte swizzle row is 128 codes, so one stage is exactly one
 * scale block) and the block's scales (a 512-byte box of sa, a 32-byte box of sb) into a
 * STAGES-deep ring. Two consumer warpgroups own 64 rows each of the 128 x BN tile. Per K block
 * and chunk of columns a warpgroup issues four `wgmma m64nNk32 .f32.e4m3.e4m3` from the swizzled
 * stage (the first with scale-d 0, so the partial sum starts from zero), waits for them, releases
 * the stage after its last chunk, and promotes the partial into its fp32 accumulators. Tiles:
 *   128x128  wgmma n128; 64 accumulators + 64 partial sums per thread; 6 stages
 *   128x192  wgmma n192; 96 + 96; 5 stages; a tile can straddle two 128-column weight blocks, so
 *            the promotion picks sb per group of 8 columns
 *   128x256  two n128 chunks per K block, each promoted before the next is issued: 128
 *            accumulators + 64 partial sums (a whole n256 partial would need 256 registers); 4 stages
 * in these arrangements of the consumers:
 *   free     both warpgroups issue a chunk as soon as its stage has landed;
 *   stag     staggered: they issue chunks in strict turn (warpgroup 1 chunk c, warpgroup 2 chunk c,
 *            warpgroup 1 chunk c + 1, ...), passed through two mbarriers, so that, if each SM
 *            sub-partition's tensor core runs wgmmas in issue order (assumed, measured here), one
 *            warpgroup's chunk is on the tensor cores while the other promotes;
 *   pipe     (128x128 only: registers) pipelined: each warpgroup issues K block kb into a second
 *            set of partial sums before it promotes block kb - 1, one wgmma group in flight;
 *   pipe64   (128x256) pipelined in 64-column chunks (m64n64k32): two sets of 32 partial sums,
 *            chunk j + 1 issued before chunk j is waited for and promoted, across K blocks, so a
 *            warpgroup always has a group in flight (128 + 64 registers, as the free tile; A is
 *            read from shared memory once per chunk, four times a K block);
 *   pipe64/K the same within each K block only: the block's last chunk is waited for and
 *            promoted before the next block's first is issued (the form for a consumer loop where
 *            ptxas does not follow a set across the loop's back edge and serialises the wgmmas:
 *            its C7514 remark);
 *   areg     (128x256) free, with A from registers: each warpgroup loads its 64 x 128 codes of
 *            the stage once (ldmatrix, 16 registers a thread: fp8_wgmma.cuh's fp8_a_fragment)
 *            and both chunks' wgmmas read them there, so A leaves shared memory once a K block
 *            instead of once a chunk (the operand bytes a stage reads from shared memory: 80 KB
 *            against 96).
 *
 * What it measures, in one run:
 *   1. correctness, before any timing, for every tile and arrangement, fp32 and bf16 output,
 *      against a reference kernel that computes the same quantised function (codes decoded
 *      exactly, each block's products summed exactly in fp64, the promotion done as above):
 *        small-int  codes in {±1, ±2, ±3}, scales powers of two over 17 binades and outlier
 *                   blocks 2^16..2^24 away: every partial sum is an integer below 2^11, which the
 *                   tensor cores (about 14 bits per block sum) add exactly, so the kernel must
 *                   match the reference bit for bit;
 *        one-hot-B  A quantised from fp32 data (codes over the whole E4M3 range, subnormals,
 *                   outliers), B one 1.0 per row per block: each partial is one product, exact:
 *                   bit for bit; checks that the hardware reads the codes as this program's
 *                   decoder does;
 *        one-hot-A  the same with the operands' roles swapped;
 *        quantised  both quantised from fp32 data whose blocks span several binades, with outlier
 *                   blocks: the tensor cores accumulate a block with fewer bits than fp32, so the
 *                   check is a bound (FP8_ACCUM_TOL) and the worst error is reported;
 *      edge shapes (M not a multiple of the tile, N a multiple of 128 only, one row, many tiles per
 *      CTA); outputs poisoned (NaN) before each run, with a poisoned guard after them. The E4M3
 *      conversion written here is checked first against cuda_fp8.h, and the bf16 baseline tile
 *      against gemm_common's fp32 reference.
 *   2. TFLOP/s of every variant (CUDA events, median of 20 after 3 warm-ups, random codes and
 *      scales, never zero) on the layers' expert GEMM shapes (16384 routed rows: DeepSeek-V3,
 *      Mixtral-8x7B, Qwen3-30B-A3B gate|up and down) beside the bf16 cooperative 128 x 256 tile
 *      of gemm_wgmma_v1 / pingpong_probe run in the same process, the FP8 / bf16 ratio (the
 *      megakernel's goal: >= 1.6), whether the FP8 tiles write the same bits, and, built with
 *      -DWITH_CUBLAS, cuBLASLt FP8 (per-tensor scaled with fast accumulation: the plain FP8
 *      ceiling; and block-scaled 1x128 / 128x128, cross-checked against the 128x128 tile).
 *   A wedged pipeline does not hang the GPU: every barrier wait gives up after 4 s and the run
 *   reports which one; a tile whose kernel gave up skips its remaining checks, and a tile that
 *   failed any check is left out of the timings (the others are still timed). A CUDA error
 *   (an illegal instruction or address) loses the context: the run prints the check it stopped
 *   in and exits. The program prints one line per check, a closing table and `N passed, N
 *   failed`; exit status 0 only if every check passed.
 *
 * Build and run from the repository root (H100/H200, CUDA 12.9+ for the cuBLASLt block scaling):
 *   mkdir -p build
 *   nvcc -std=c++17 -O3 -Isrc -Iinclude -gencode=arch=compute_90a,code=sm_90a -Xptxas -v \
 *        dev/fp8_tile_probe.cu -o build/fp8_tile_probe && ./build/fp8_tile_probe [seed]
 * with the cuBLASLt baselines: add -DWITH_CUBLAS before the source and -lcublasLt after it. To look
 * at one failure alone: `--case I` runs the fp8 checks of test shape I only (no timings), `--variant
 * NAME` (e.g. 128x128-free, or its index) checks and times that tile only; a wrong option prints
 * the list of both. Each timed layer runs inside an NVTX range "layerI" (I its index in LAYERS), so
 * that Nsight Compute can profile one of its launches:
 *   ncu --clock-control none --nvtx --nvtx-include "layer0/" -k regex:fp8_tile_kernel -c 1 --set full \
 *       ./build/fp8_tile_probe --variant 128x256-free */
#include "gemm_common.cuh"

#include "cuda/sm90/fp8_wgmma.cuh" /* the E4M3 wgmma the megakernel's FP8 tile runs */

#include <cuda_fp8.h>
#include <nvtx3/nvToolsExt.h>
#ifdef WITH_CUBLAS
#include <cublasLt.h>
#endif

/* ------------------------------------------------------------------------------------------ */
/* Tile configuration.                                                                        */

constexpr int FP8_BK = 128;          // K per stage: 128 codes = 128 bytes, one 128B swizzle row
constexpr int SCALE_BLOCK = 128;     // the scales' block edge (1x128 activations, 128x128 weights)
constexpr int WGMMA_K_FP8 = 32;      // K of one e4m3 wgmma: 32 codes = 32 bytes = +2 in a descriptor
constexpr int SA_BYTES = BM * 4;     // a stage's activation scales: one fp32 per tile row
constexpr int SCALE_SLOT_BYTES = 640;  // per stage: sa at 0, sb at 512; 128-byte aligned slots

/* NOTE (TMA rule): a tensor load reads global memory from its box's first element, and that
 * address must be 16-byte aligned, or the load is an illegal instruction (sm_90); encoding the map
 * does not check it, since it depends on the coordinates. The maps' bases and row strides are
 * 16-byte aligned, so the inner coordinate must be a multiple of 16 bytes' worth of elements: codes
 * at multiples of 128 and sa at multiples of BM always are, but a tile's first 128-column block,
 * the sb coordinate, can be any integer. So a stage's sb box starts at that block rounded down to
 * a multiple of SB_ALIGN and is two of those wide: the tile's blocks nb and nb + 1 are at box
 * positions nb % SB_ALIGN and nb % SB_ALIGN + 1 <= SB_ALIGN, both inside it. */
constexpr int SB_ALIGN = 16 / (int)sizeof(float);  // fp32 scales per 16 bytes
constexpr int SB_BOX = 2 * SB_ALIGN;               // a stage's weight scales: 32 bytes
static __host__ __device__ __forceinline__ int sb_box_first(int n0) { return n0 / SCALE_BLOCK / SB_ALIGN * SB_ALIGN; }
static __host__ __device__ __forceinline__ int sb_box_offset(int n0) { return n0 / SCALE_BLOCK % SB_ALIGN; }
constexpr int CONSUMER_WARPS = NUM_CONSUMERS * WG_THREADS / 32;
static_assert(FP8_BK == SCALE_BLOCK, "one stage must be one scale block");
static_assert(SA_BYTES + SB_BOX * 4 <= SCALE_SLOT_BYTES && SCALE_SLOT_BYTES % 128 == 0 && SA_BYTES % 128 == 0,
              "scale slot layout: TMA writes shared memory at 128-byte aligned addresses");
static_assert((SB_BOX * sizeof(float)) % 16 == 0 && SB_BOX >= SB_ALIGN + 1, "sb box: 16-byte rows, both blocks inside");

template <int BN_>
struct Fp8Tile {
    static constexpr int BN = BN_;                          // columns of C per tile
    static constexpr int CHUNK_N = BN_ == 256 ? 128 : BN_;  // wgmma N of one chunk
    static constexpr int CHUNKS = BN_ / CHUNK_N;
    static constexpr int ACC = BN_ / 2;                     // fp32 accumulators per consumer thread
    static constexpr int CHUNK_ACC = CHUNK_N / 2;           // partial sums per consumer thread
    static constexpr int STAGES = BN_ == 128 ? 6 : BN_ == 192 ? 5 : 4;
    static constexpr int A_BYTES = BM * FP8_BK;             // 16 KB
    static constexpr int B_BYTES = BN_ * FP8_BK;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int STAGE_TX = STAGE_BYTES + SA_BYTES + SB_BOX * 4;  // what one full[] phase carries
    static constexpr int GROUP_N = 2048 / BN_;              // tile order: bands of ~2048 columns
    // operand ring, scale slots, full[], empty[], turn[2]; +1024: the ring is aligned by hand
    static constexpr int SMEM_BYTES =
        STAGES * (STAGE_BYTES + SCALE_SLOT_BYTES) + (2 * STAGES + 2) * 8 + SWIZZLE_ATOM_BYTES;
    static_assert(BN_ == 128 || BN_ == 192 || BN_ == 256, "tiles are 128 x {128, 192, 256}");
    static_assert(B_BYTES % SWIZZLE_ATOM_BYTES == 0 && (CHUNK_N * FP8_BK) % SWIZZLE_ATOM_BYTES == 0,
                  "every operand tile and chunk must start on a swizzle atom (descriptor base offset 0)");
    static_assert(SMEM_BYTES <= 227 * 1024, "ring does not fit in shared memory");
};

/* ------------------------------------------------------------------------------------------ */
/* e4m3 wgmma. Both operands from shared memory, K-major (e4m3 has no transpose), fp32 accumulators
 * in the same fragment layout as bf16's. scale_d == 0 overwrites d.                         */

#define FP8_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                    "+f"(d[i + 6]), "+f"(d[i + 7])

/* wgmma_e4m3_n128: the library's own (src/cuda/sm90/fp8_wgmma.cuh, included above). */

static __device__ __forceinline__ void wgmma_e4m3_n192(float (&d)[96], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
        "%96, %97, p, 1, 1;\n"
        "}\n"
        : FP8_ACC8(0), FP8_ACC8(8), FP8_ACC8(16), FP8_ACC8(24), FP8_ACC8(32), FP8_ACC8(40), FP8_ACC8(48),
          FP8_ACC8(56), FP8_ACC8(64), FP8_ACC8(72), FP8_ACC8(80), FP8_ACC8(88)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d)
        : "memory");
}

static __device__ __forceinline__ void wgmma_e4m3_n64(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1;\n"
        "}\n"
        : FP8_ACC8(0), FP8_ACC8(8), FP8_ACC8(16), FP8_ACC8(24)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d)
        : "memory");
}
#undef FP8_ACC8

template <int CHUNK_N>
static __device__ __forceinline__ void wgmma_e4m3(float (&d)[CHUNK_N / 2], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
    if constexpr (CHUNK_N == 192)
        wgmma_e4m3_n192(d, desc_a, desc_b, scale_d);
    else
        wgmma_e4m3_n128(d, desc_a, desc_b, scale_d);
}

/* ------------------------------------------------------------------------------------------ */
/* The kernel.                                                                                */

/* The producer thread: for each of the CTA's tiles and each K block, the A and B codes and the
 * block's scales (sb from a 16-byte aligned box: the TMA rule) into the next ring stage; full[s]
 * gets STAGE_TX bytes (out-of-bounds rows, columns and scales arrive as zeros and count too); a
 * stage is refilled once empty[s] has completed (every consumer warp done with it). Returns early
 * if a wait timed out. */
template <class Cfg>
static __device__ __forceinline__ void produce_fp8(const CUtensorMap *map_a, const CUtensorMap *map_b,
                                                   const CUtensorMap *map_sa, const CUtensorMap *map_sb,
                                                   uint32_t ring, uint32_t scales, uint32_t full_bar,
                                                   uint32_t empty_bar, int num_m, int num_n, int num_kb, int *err) {
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        for (int kb = 0; kb < num_kb; ++kb) {
            if (!mbar_wait(empty_bar + 8 * stage, phase ^ 1, err, KERNEL_EMPTY_TIMEOUT)) return;
            const uint32_t full = full_bar + 8 * stage;
            const uint32_t operands = ring + stage * Cfg::STAGE_BYTES;
            const uint32_t slot = scales + stage * SCALE_SLOT_BYTES;
            mbar_arrive_expect_tx(full, Cfg::STAGE_TX);
            tma_load_2d(operands, map_a, kb * FP8_BK, pos.m0, full);
            tma_load_2d(operands + Cfg::A_BYTES, map_b, kb * FP8_BK, pos.n0, full);
            tma_load_2d(slot, map_sa, pos.m0, kb, full);
            tma_load_2d(slot + SA_BYTES, map_sb, sb_box_first(pos.n0), kb, full);  // see the TMA rule
            if (++stage == Cfg::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
}

static __device__ __forceinline__ void store_pair(float *p, float a, float b) {
    *reinterpret_cast<float2 *>(p) = make_float2(a, b);
}
static __device__ __forceinline__ void store_pair(bf16 *p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162 *>(p) = __floats2bfloat162_rn(a, b);
}

/* Stores a consumer's 64 x BN block. Accumulator layout (m64nN f32, per chunk): registers 4i+{0,1}
 * hold row `row` = 16·warp + lane/4 of the warpgroup's 64, columns 8i + 2·(lane%4) + {0,1} of the
 * chunk; registers 4i+{2,3} the same columns 8 rows down. N is a multiple of 128, so a group of 8
 * columns is either all inside C or all outside. */
template <class Cfg, class Out>
static __device__ __forceinline__ void store_tile(const float (&acc)[Cfg::ACC], Out *C, int M, int N, int row,
                                                  int n0, int lane) {
#pragma unroll
    for (int c = 0; c < Cfg::CHUNKS; ++c)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row + 8 * half;
            if (r >= M) continue;
            Out *c_row = C + (size_t)r * N;
#pragma unroll
            for (int i = 0; i < Cfg::CHUNK_ACC / 4; ++i) {
                const int col = n0 + c * Cfg::CHUNK_N + 8 * i + 2 * (lane % 4);
                if (col < N)
                    store_pair(c_row + col, acc[c * Cfg::CHUNK_ACC + 4 * i + 2 * half],
                               acc[c * Cfg::CHUNK_ACC + 4 * i + 2 * half + 1]);
            }
        }
}

/* acc[chunk] = fma(partial, sa[row] * sb[column's block], acc[chunk]): the promotion of one chunk.
 * sa_lo / sa_hi are the scales of the thread's two rows, sb0 / sb1 those of the tile's first two
 * 128-column blocks. Tiles of 128 or 256 columns start on a block, so chunk c is block c; a
 * 192-column tile starting 64 columns into a block moves to the next block at column group
 * `split_i` (groups of 8 columns; 16 when the tile starts on a block). */
template <class Cfg>
static __device__ __forceinline__ void promote(float (&acc)[Cfg::ACC], const float (&partial)[Cfg::CHUNK_ACC],
                                               int chunk, float sa_lo, float sa_hi, float sb0, float sb1,
                                               int split_i) {
    const float sb_chunk = chunk == 0 ? sb0 : sb1;
    const float lo0 = sa_lo * sb_chunk, hi0 = sa_hi * sb_chunk;  // powers of two: exact
    const float lo1 = sa_lo * sb1, hi1 = sa_hi * sb1;
#pragma unroll
    for (int i = 0; i < Cfg::CHUNK_ACC / 4; ++i) {
        const bool next_block = Cfg::BN % SCALE_BLOCK != 0 && i >= split_i;
        const float lo = next_block ? lo1 : lo0, hi = next_block ? hi1 : hi0;
        float *a = acc + chunk * Cfg::CHUNK_ACC + 4 * i;
        a[0] = __fmaf_rn(partial[4 * i + 0], lo, a[0]);
        a[1] = __fmaf_rn(partial[4 * i + 1], lo, a[1]);
        a[2] = __fmaf_rn(partial[4 * i + 2], hi, a[2]);
        a[3] = __fmaf_rn(partial[4 * i + 3], hi, a[3]);
    }
}

/* A consumer thread's place: its warpgroup (consumer 0 or 1: tile rows 64 consumer ..), its lane,
 * the tile row of its registers 4i+{0,1}, and the descriptors of its warpgroup's A rows and of B
 * in stage 0 of the ring. */
struct ConsumerPlace {
    int consumer, lane, row;
    uint64_t desc_a0, desc_b0;
};
template <class Cfg>
static __device__ __forceinline__ ConsumerPlace consumer_place(uint32_t ring) {
    const int consumer = threadIdx.x / WG_THREADS - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    return {consumer, lane, consumer * 64 + warp * 16 + lane / 4, make_smem_desc(ring + consumer * 64 * FP8_BK),
            make_smem_desc(ring + Cfg::A_BYTES)};
}

/* A stage's scales as one consumer thread uses them, and the stage they came from. */
struct StageScales {
    float sa_lo, sa_hi, sb0, sb1;
    int stage;
};

/* Waits for stage `stage` (parity `phase`) and reads the thread's scales from its slot; false if
 * the wait gave up (the warpgroup's wgmmas drained first). */
static __device__ __forceinline__ bool enter_stage(const uint8_t *scale_slots, uint32_t full_bar, int stage,
                                                   uint32_t phase, int row, int sb_at, int *err, StageScales &out) {
    if (!mbar_wait(full_bar + 8 * stage, phase, err, KERNEL_FULL_TIMEOUT)) {
        wgmma_wait<0>();
        return false;
    }
    // Threads leave the spin loop one by one; wgmma is .sync.aligned.
    __syncwarp();
    const float *slot = reinterpret_cast<const float *>(scale_slots + stage * SCALE_SLOT_BYTES);
    out = {slot[row], slot[row + 8], slot[sb_at], slot[sb_at + 1], stage};
    return true;
}

/* The consumers. NOTE (ring protocol, as gemm_wgmma_v1): full[s] completes with the producer's
 * arrive.expect_tx and the TMA bytes; empty[s] counts 8 arrivals (lane 0 of each consumer warp,
 * after the wait that shows its last chunk's wgmmas on stage s complete; the stage's scales were
 * read into registers before that arrive, whose release orders those reads before the refill).
 * NOTE (stagger, STAGGER only): turn[c] (c = consumer 0 or 1, warpgroups 1 and 2) has count 4;
 * the other consumer's warps arrive on it once they have issued a chunk, and consumer c waits on
 * it before each chunk (consumer 0 skips the wait before the CTA's first chunk). Neither can run
 * a phase ahead: each signal follows a wait for the other's previous signal, so the parity of a
 * waiter's count of waits names the right phase. Both consumers walk the same chunks, so none is
 * left waiting. */
template <class Cfg, bool STAGGER, bool A_REGS>
static __device__ __forceinline__ void consume_fp8(const uint8_t *scale_slots, uint32_t ring, uint32_t full_bar,
                                                   uint32_t empty_bar, uint32_t turn_bar, bf16 *C16, float *C32,
                                                   int M, int N, int num_m, int num_n, int num_kb, int *err) {
    const ConsumerPlace me = consumer_place<Cfg>(ring);
    const int consumer = me.consumer, lane = me.lane, row = me.row;
    const uint64_t desc_a0 = me.desc_a0, desc_b0 = me.desc_b0;
    constexpr uint64_t chunk_step = (Cfg::CHUNK_N * FP8_BK) >> 4;  // descriptor units of 16 bytes
    constexpr uint64_t k_step = WGMMA_K_FP8 >> 4;

    static_assert(!A_REGS || Cfg::CHUNK_N == 128, "A from registers: m64n128k32 chunks only");
    const uint32_t a_half0 = ring + consumer * 64 * FP8_BK, a_offset = fp8_a_fragment_offset();
    float acc[Cfg::ACC];
    float partial[Cfg::CHUNK_ACC];
    uint32_t ra[FP8_BK / WGMMA_K_FP8][4];
    int stage = 0;
    uint32_t phase = 0, turn_phase = 0;
    bool wait_turn = consumer == 1;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        const int split_i = (SCALE_BLOCK - pos.n0 % SCALE_BLOCK) / 8;
        const int sb_at = BM + sb_box_offset(pos.n0);  // the tile's first block in the slot's sb box
#pragma unroll
        for (int i = 0; i < Cfg::ACC; ++i) acc[i] = 0.0f;
        for (int kb = 0; kb < num_kb; ++kb) {
            StageScales sc;
            if (!enter_stage(scale_slots, full_bar, stage, phase, row, sb_at, err, sc)) return;
            const float sa_lo = sc.sa_lo, sa_hi = sc.sa_hi, sb0 = sc.sb0, sb1 = sc.sb1;
            const uint64_t stage_offset = (uint64_t)((stage * Cfg::STAGE_BYTES) >> 4);
            if (A_REGS) {
#pragma unroll
                for (int k = 0; k < FP8_BK / WGMMA_K_FP8; ++k)
                    fp8_a_fragment(ra[k], a_half0 + stage * Cfg::STAGE_BYTES, a_offset, k);
            }
#pragma unroll
            for (int c = 0; c < Cfg::CHUNKS; ++c) {
                if (STAGGER) {
                    if (wait_turn) {
                        if (!mbar_wait(turn_bar + 8 * consumer, turn_phase, err, KERNEL_ORDER_TIMEOUT)) {
                            wgmma_wait<0>();
                            return;
                        }
                        turn_phase ^= 1;
                        __syncwarp();
                    }
                    wait_turn = true;
                }
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < FP8_BK / WGMMA_K_FP8; ++k) {
                    const uint64_t desc_b = desc_b0 + stage_offset + chunk_step * c + k_step * k;
                    if constexpr (A_REGS)
                        wgmma_e4m3_n128_ra(partial, ra[k], desc_b, k);
                    else
                        wgmma_e4m3<Cfg::CHUNK_N>(partial, desc_a0 + stage_offset + k_step * k, desc_b, k);
                }
                wgmma_commit();
                if (STAGGER && lane == 0) mbar_arrive(turn_bar + 8 * (1 - consumer));
                wgmma_wait<0>();
                pin_accumulators(partial);
                if (c == Cfg::CHUNKS - 1 && lane == 0) mbar_arrive(empty_bar + 8 * stage);
                promote<Cfg>(acc, partial, c, sa_lo, sa_hi, sb0, sb1, split_i);
            }
            if (++stage == Cfg::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
        if (C32)
            store_tile<Cfg>(acc, C32, M, N, pos.m0 + row, pos.n0, lane);
        else
            store_tile<Cfg>(acc, C16, M, N, pos.m0 + row, pos.n0, lane);
    }
}

/* One step of the pipelined consumer: waits for the next stage, reads its scales, issues its four
 * wgmmas into `into`; then, if `has_prev`, waits until only that group is in flight (so the
 * previous block's, in `prev`, is complete: groups complete in order), releases the previous
 * block's stage and promotes `prev` while `into` is on the tensor cores. Returns false if a wait
 * timed out. */
template <class Cfg>
static __device__ __forceinline__ bool pipelined_step(float (&acc)[Cfg::ACC], float (&into)[Cfg::CHUNK_ACC],
                                                      float (&prev)[Cfg::CHUNK_ACC], bool has_prev,
                                                      StageScales &prev_scales, int &stage, uint32_t &phase,
                                                      const uint8_t *scale_slots, uint64_t desc_a0, uint64_t desc_b0,
                                                      uint32_t full_bar, uint32_t empty_bar, int row, int lane,
                                                      int sb_at, int split_i, int *err) {
    StageScales cur;
    if (!enter_stage(scale_slots, full_bar, stage, phase, row, sb_at, err, cur)) return false;
    const uint64_t stage_offset = (uint64_t)((stage * Cfg::STAGE_BYTES) >> 4);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < FP8_BK / WGMMA_K_FP8; ++k)
        wgmma_e4m3<Cfg::CHUNK_N>(into, desc_a0 + stage_offset + (WGMMA_K_FP8 >> 4) * k,
                                 desc_b0 + stage_offset + (WGMMA_K_FP8 >> 4) * k, k);
    wgmma_commit();
    if (has_prev) {
        wgmma_wait<1>();
        pin_accumulators(prev);
        if (lane == 0) mbar_arrive(empty_bar + 8 * prev_scales.stage);
        promote<Cfg>(acc, prev, 0, prev_scales.sa_lo, prev_scales.sa_hi, prev_scales.sb0, prev_scales.sb1, split_i);
    }
    prev_scales = cur;
    if (++stage == Cfg::STAGES) {
        stage = 0;
        phase ^= 1;
    }
    return true;
}

/* The pipelined consumers: each warpgroup keeps one K block in flight, block kb's wgmmas going
 * into one set of partial sums (even or odd kb) while block kb - 1's, in the other, are promoted,
 * so a warpgroup overlaps its own promotion with its own wgmmas, whatever order the tensor cores
 * take the two warpgroups' work in. Two sets of partials: 64 accumulators + 2 x 64 partial sums
 * per thread, so the 128x128 tile only. Ring protocol as consume_fp8's, a stage released one
 * block later (after the wait that shows its group complete). */
template <class Cfg>
static __device__ __forceinline__ void consume_fp8_pipelined(const uint8_t *scale_slots, uint32_t ring,
                                                             uint32_t full_bar, uint32_t empty_bar, bf16 *C16,
                                                             float *C32, int M, int N, int num_m, int num_n,
                                                             int num_kb, int *err) {
    static_assert(Cfg::CHUNKS == 1 && Cfg::ACC + 2 * Cfg::CHUNK_ACC <= 192, "two partial sets fit 128x128 only");
    static_assert(Cfg::STAGES >= 2, "a warpgroup holds block kb - 1's stage while it waits for block kb's");
    const ConsumerPlace me = consumer_place<Cfg>(ring);
    const int lane = me.lane, row = me.row;
    const uint64_t desc_a0 = me.desc_a0, desc_b0 = me.desc_b0;

    float acc[Cfg::ACC];
    float even[Cfg::CHUNK_ACC], odd[Cfg::CHUNK_ACC];
    int stage = 0;
    uint32_t phase = 0;
    StageScales prev_scales = {0.0f, 0.0f, 0.0f, 0.0f, 0};
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        const int split_i = (SCALE_BLOCK - pos.n0 % SCALE_BLOCK) / 8;
        const int sb_at = BM + sb_box_offset(pos.n0);
#pragma unroll
        for (int i = 0; i < Cfg::ACC; ++i) acc[i] = 0.0f;
        for (int kb = 0; kb < num_kb; kb += 2) {
            if (!pipelined_step<Cfg>(acc, even, odd, kb > 0, prev_scales, stage, phase, scale_slots, desc_a0, desc_b0,
                                     full_bar, empty_bar, row, lane, sb_at, split_i, err))
                return;
            if (kb + 1 < num_kb &&
                !pipelined_step<Cfg>(acc, odd, even, true, prev_scales, stage, phase, scale_slots, desc_a0, desc_b0,
                                     full_bar, empty_bar, row, lane, sb_at, split_i, err))
                return;
        }
        /* the tile's last block: in `even` when num_kb is odd (a branch each: the two sets must stay
           in registers) */
        wgmma_wait<0>();
        if (lane == 0) mbar_arrive(empty_bar + 8 * prev_scales.stage);
        if (num_kb & 1) {
            pin_accumulators(even);
            promote<Cfg>(acc, even, 0, prev_scales.sa_lo, prev_scales.sa_hi, prev_scales.sb0, prev_scales.sb1, split_i);
        } else {
            pin_accumulators(odd);
            promote<Cfg>(acc, odd, 0, prev_scales.sa_lo, prev_scales.sa_hi, prev_scales.sb0, prev_scales.sb1, split_i);
        }
        if (C32)
            store_tile<Cfg>(acc, C32, M, N, pos.m0 + row, pos.n0, lane);
        else
            store_tile<Cfg>(acc, C16, M, N, pos.m0 + row, pos.n0, lane);
    }
}

/* acc's 64-column chunk c += part · (lo for the thread's first row, hi for its second), as promote. */
template <class Cfg>
static __device__ __forceinline__ void promote64(float (&acc)[Cfg::ACC], const float (&part)[32], int c, float lo,
                                                 float hi) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float &a = acc[32 * c + 4 * i + j];
            a = __fmaf_rn(part[4 * i + j], j < 2 ? lo : hi, a);
        }
}

/* The 128 x 256 tile pipelined in 64-column chunks: each K block's four n64 chunks (four m64n64k32
 * wgmmas each) go into two sets of 32 partial sums in turn, and a warpgroup issues chunk j + 1
 * before it waits for chunk j and promotes it, so one group is always in flight, across K blocks
 * too: 128 accumulators + 2 x 32 partial sums per thread. The price: A's 64 rows of the stage are
 * read from shared memory once per chunk (four times a K block, against twice for the free tile's
 * n128 chunks). A stage is released after its last chunk's wait. The first chunk of a tile has no
 * predecessor: it "promotes" the zeroed second set with scale 0 (fma(0, 0, +0) = +0), so the
 * accumulators are written on every path (no branch around wgmma operands). */
template <class Cfg, bool CROSS>
static __device__ __forceinline__ void consume_fp8_pipe64(const uint8_t *scale_slots, uint32_t ring,
                                                          uint32_t full_bar, uint32_t empty_bar, bf16 *C16,
                                                          float *C32, int M, int N, int num_m, int num_n,
                                                          int num_kb, int *err) {
    static_assert(Cfg::BN == 256, "the 128 x 256 tile");
    constexpr int CN = 64, CACC = CN / 2, CH = Cfg::BN / CN;
    static_assert(CH % 2 == 0, "a chunk's set is its index's parity, across K blocks");
    const ConsumerPlace me = consumer_place<Cfg>(ring);
    const int lane = me.lane, row = me.row;
    const uint64_t desc_a0 = me.desc_a0, desc_b0 = me.desc_b0;
    constexpr uint64_t chunk_step = (CN * FP8_BK) >> 4, k_step = WGMMA_K_FP8 >> 4;

    float acc[Cfg::ACC];
    float set[2][CACC];
    int stage = 0, prev_stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        const int sb_at = BM + sb_box_offset(pos.n0);
#pragma unroll
        for (int i = 0; i < Cfg::ACC; ++i) acc[i] = 0.0f;
#pragma unroll
        for (int i = 0; i < CACC; ++i) set[1][i] = 0.0f;
        float prev_lo = 0.0f, prev_hi = 0.0f;  // the chunk in flight before the last one: its scales
        for (int kb = 0; kb < num_kb; ++kb) {
            StageScales sc;  // this block's
            if (!enter_stage(scale_slots, full_bar, stage, phase, row, sb_at, err, sc)) return;
            const uint64_t stage_offset = (uint64_t)((stage * Cfg::STAGE_BYTES) >> 4);
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                float (&into)[CACC] = set[c & 1];
                float (&prev)[CACC] = set[(c + 1) & 1];
                wgmma_fence();
#pragma unroll
                for (int k = 0; k < FP8_BK / WGMMA_K_FP8; ++k)
                    wgmma_e4m3_n64(into, desc_a0 + stage_offset + k_step * k,
                                   desc_b0 + stage_offset + chunk_step * c + k_step * k, k);
                wgmma_commit();
                if (CROSS || c > 0) {
                    wgmma_wait<1>();
                    pin_accumulators(prev);
                    /* the previous K block's last chunk is complete: its stage goes back */
                    if (c == 0 && kb > 0 && lane == 0) mbar_arrive(empty_bar + 8 * prev_stage);
                    promote64<Cfg>(acc, prev, (c + CH - 1) % CH, prev_lo, prev_hi);
                }
                const float sb = c < CH / 2 ? sc.sb0 : sc.sb1;  // powers of two: exact products
                prev_lo = sc.sa_lo * sb;
                prev_hi = sc.sa_hi * sb;
            }
            if (!CROSS) {  // the block's last chunk, before the next block's first is issued
                wgmma_wait<0>();
                pin_accumulators(set[1]);
                if (lane == 0) mbar_arrive(empty_bar + 8 * stage);
                promote64<Cfg>(acc, set[1], CH - 1, prev_lo, prev_hi);
            }
            prev_stage = stage;
            if (++stage == Cfg::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
        /* the tile's last chunk (index CH - 1, in set 1) */
        if (CROSS) {
            wgmma_wait<0>();
            pin_accumulators(set[1]);
            if (num_kb > 0 && lane == 0) mbar_arrive(empty_bar + 8 * prev_stage);
            promote64<Cfg>(acc, set[1], CH - 1, prev_lo, prev_hi);
        }
        /* acc's chunk c of 64 columns is store_tile's columns 64 c ..: the same layout as two n128
           chunks (register 4 i of an n128 chunk is column 8 i, i < 16: the first 64 columns) */
        if (C32)
            store_tile<Cfg>(acc, C32, M, N, pos.m0 + row, pos.n0, lane);
        else
            store_tile<Cfg>(acc, C16, M, N, pos.m0 + row, pos.n0, lane);
    }
}

/* C = the block-scaled product of A[M, K] and B[N, K] (see the top of the file), into C32 (fp32)
 * if it is not null, else into C16 (bf16). grid = min(#SMs, #tiles), block = 384 threads, one
 * CTA per SM. K % 128 == 0, N % 128 == 0, M >= 1. */
enum Arrangement {
    ARRANGE_FREE, ARRANGE_STAGGERED, ARRANGE_PIPELINED, ARRANGE_PIPE64, ARRANGE_PIPE64_BLOCK, ARRANGE_AREG
};

template <int BN_, int ARRANGE>
__global__ void __launch_bounds__(THREADS, 1)
    fp8_tile_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    const __grid_constant__ CUtensorMap map_sa, const __grid_constant__ CUtensorMap map_sb,
                    bf16 *__restrict__ C16, float *__restrict__ C32, int M, int N, int K, int *err) {
    using Cfg = Fp8Tile<BN_>;
    constexpr int STAGES = Cfg::STAGES;
    extern __shared__ uint8_t smem_raw[];
    // The ring starts on a swizzle atom: TMA writes the 128B pattern by address bits and the
    // descriptors say base offset 0. Scale slots follow it (1024-aligned, 640-byte slots).
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t ring = (raw + SWIZZLE_ATOM_BYTES - 1) & ~(uint32_t)(SWIZZLE_ATOM_BYTES - 1);
    const uint32_t scales = ring + STAGES * Cfg::STAGE_BYTES;
    const uint32_t full_bar = scales + STAGES * SCALE_SLOT_BYTES;
    const uint32_t empty_bar = full_bar + STAGES * 8;
    const uint32_t turn_bar = empty_bar + STAGES * 8;  // [2], staggered only

    const int num_m = (M + BM - 1) / BM;
    const int num_n = (N + Cfg::BN - 1) / Cfg::BN;
    const int num_kb = K / FP8_BK;
    const int warpgroup = threadIdx.x / WG_THREADS;

    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        prefetch_tensormap(&map_sa);
        prefetch_tensormap(&map_sb);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8 * s, 1);
            mbar_init(empty_bar + 8 * s, CONSUMER_WARPS);
        }
        mbar_init(turn_bar, 4);
        mbar_init(turn_bar + 8, 4);
        fence_barrier_init();
    }
    // The last block-wide barrier: after the role split, warps leave at different times.
    __syncthreads();

    if (warpgroup == 0) {
        /* Producer: one thread issues every TMA; the other 127 only give their registers back. */
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        produce_fp8<Cfg>(&map_a, &map_b, &map_sa, &map_sb, ring, scales, full_bar, empty_bar, num_m, num_n, num_kb,
                         err);
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();
    if constexpr (ARRANGE == ARRANGE_PIPE64 || ARRANGE == ARRANGE_PIPE64_BLOCK)
        consume_fp8_pipe64<Cfg, ARRANGE == ARRANGE_PIPE64>(smem_raw + (scales - raw), ring, full_bar, empty_bar, C16,
                                                           C32, M, N, num_m, num_n, num_kb, err);
    else if constexpr (ARRANGE == ARRANGE_PIPELINED)
        consume_fp8_pipelined<Cfg>(smem_raw + (scales - raw), ring, full_bar, empty_bar, C16, C32, M, N, num_m, num_n,
                                   num_kb, err);
    else
        consume_fp8<Cfg, ARRANGE == ARRANGE_STAGGERED, ARRANGE == ARRANGE_AREG>(
            smem_raw + (scales - raw), ring, full_bar, empty_bar, turn_bar, C16, C32, M, N, num_m, num_n, num_kb, err);
}

/* ------------------------------------------------------------------------------------------ */
/* The bf16 baseline: the cooperative 128 x 256 tile of gemm_wgmma_v1.cu (K-major operands) and
 * pingpong_probe.cu (coop, no synthetic epilogue), its main loop repeated here so that both
 * precisions run in one process: gemm_common's producer, m64n256k16, one wgmma group in flight. */

struct Bf16Coop {
    static constexpr int BN = 256;
    static constexpr int STAGES = 4;
    static constexpr int A_BYTES = BM * BK * 2;
    static constexpr int B_BYTES = BN * BK * 2;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int GROUP_N = 2048 / BN;
    static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8 + SWIZZLE_ATOM_BYTES;
};

__global__ void __launch_bounds__(THREADS, 1)
    bf16_coop_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                     bf16 *__restrict__ C, int M, int N, int K, int *err) {
    using Cfg = Bf16Coop;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t ring = (raw + SWIZZLE_ATOM_BYTES - 1) & ~(uint32_t)(SWIZZLE_ATOM_BYTES - 1);
    const uint32_t full_bar = ring + Cfg::STAGES * Cfg::STAGE_BYTES;
    const uint32_t empty_bar = full_bar + Cfg::STAGES * 8;
    const int num_m = (M + BM - 1) / BM, num_n = (N + Cfg::BN - 1) / Cfg::BN, num_k = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / WG_THREADS;
    if (threadIdx.x == 0) {
        prefetch_tensormap(&map_a);
        prefetch_tensormap(&map_b);
        for (int s = 0; s < Cfg::STAGES; ++s) {
            mbar_init(full_bar + 8 * s, 1);
            mbar_init(empty_bar + 8 * s, CONSUMER_WARPS);
        }
        fence_barrier_init();
    }
    __syncthreads();
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        produce_tiles<Cfg, 0, 0>(&map_a, &map_b, ring, full_bar, empty_bar, num_m, num_n, num_k, err);
        return;
    }
    setmaxnreg_inc<CONSUMER_REGS>();
    const int consumer = warpgroup - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const uint64_t desc_a0 = make_smem_desc(ring + consumer * 64 * 128);
    const uint64_t desc_b0 = make_smem_desc(ring + Cfg::A_BYTES);
    float acc[128];
    RingCursor cur;
    for (int tile = blockIdx.x; tile < num_m * num_n; tile += gridDim.x) {
        const TilePos pos = tile_at<Cfg>(tile, num_m, num_n);
        if (!coop_k_loop<Cfg::STAGES, Cfg::STAGE_BYTES, 128, 0, 0>(acc, cur, full_bar, empty_bar, desc_a0, desc_b0, 2, 2,
                                                                   num_k, err))
            return;
        const int row0 = pos.m0 + consumer * 64 + warp * 16 + lane / 4, col0 = pos.n0 + 2 * (lane % 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row0 + 8 * half;
            if (r >= M) continue;
#pragma unroll
            for (int i = 0; i < 32; ++i)
                if (col0 + 8 * i < N) store_pair(C + (size_t)r * N + col0 + 8 * i, acc[4 * i + 2 * half], acc[4 * i + 2 * half + 1]);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Reference and input kernels.                                                               */

/* The quantised function of the top of the file, one thread per output, from the codes and the
 * scales as stored: each code decoded through `decode_table` (this program's E4M3 decoder, checked
 * against cuda_fp8.h), each product exact in fp32 (two 4-bit significands), each block's products
 * summed exactly in fp64 (their exponents span < 40 bits). Writes
 *   ref32   the fp32 promotion exactly as the tile does it, acc = fma(fp32(partial), sa * sb, acc),
 *           which the tile must match bit for bit wherever the tensor cores sum a block exactly
 *           (fp32(partial) is then the partial itself);
 *   ref64   sum over blocks of partial * sa * sb in fp64: the exact quantised function;
 *   ref_abs sum over blocks of sa * sb * sum |products|: the size the accumulation error scales with.
 * Blocks of 32 (n) x 8 (m) threads: a warp shares one row of A, the block's warps 32 rows of B. */
constexpr int REF_FP8_BLOCK_N = 32, REF_FP8_BLOCK_M = 8;
__global__ void reference_fp8_gemm(const uint8_t *__restrict__ A, const uint8_t *__restrict__ B,
                                   const float *__restrict__ sa, int ld_sa, const float *__restrict__ sb, int ld_nb,
                                   const float *__restrict__ decode_table, float *__restrict__ ref32,
                                   double *__restrict__ ref64, double *__restrict__ ref_abs, int M, int N, int K) {
    __shared__ float decode[256];
    for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < 256; i += blockDim.x * blockDim.y)
        decode[i] = decode_table[i];
    __syncthreads();
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y * blockDim.y + threadIdx.y;
    if (n >= N || m >= M) return;
    const uint4 *a = reinterpret_cast<const uint4 *>(A + (size_t)m * K);
    const uint4 *b = reinterpret_cast<const uint4 *>(B + (size_t)n * K);
    float acc = 0.0f;
    double exact = 0.0, bound = 0.0;
    for (int kb = 0; kb < K / SCALE_BLOCK; ++kb) {
        double partial = 0.0, partial_abs = 0.0;
        for (int c = 0; c < SCALE_BLOCK / 16; ++c) {
            const uint4 va = a[kb * (SCALE_BLOCK / 16) + c], vb = b[kb * (SCALE_BLOCK / 16) + c];
            const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float p = decode[(wa[j / 4] >> (8 * (j % 4))) & 255] * decode[(wb[j / 4] >> (8 * (j % 4))) & 255];
                partial += (double)p;
                partial_abs += (double)fabsf(p);
            }
        }
        const float s = sa[(size_t)kb * ld_sa + m] * sb[(size_t)kb * ld_nb + n / SCALE_BLOCK];
        acc = __fmaf_rn(__double2float_rn(partial), s, acc);
        exact += partial * (double)s;
        bound += partial_abs * (double)s;
    }
    const size_t o = (size_t)m * N + n;
    ref32[o] = acc;
    ref64[o] = exact;
    ref_abs[o] = bound;
}

static __device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Random E4M3 codes for the timings: every finite nonzero code, both signs (NaN and zero codes
 * are moved to a neighbour); a pure function of (seed, index). */
__global__ void fill_random_e4m3(uint8_t *x, size_t count, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        uint8_t c = (uint8_t)mix64(seed + 0x9E3779B97F4A7C15ull * (i + 1));
        if ((c & 0x7F) == 0x7F) c -= 1;         // NaN -> ±448
        else if ((c & 0x7F) == 0) c |= 0x38;    // ±0 -> ±1
        x[i] = c;
    }
}

/* Random power-of-two scales 2^lo_exp .. 2^(lo_exp + span - 1). */
__global__ void fill_random_pow2(float *x, size_t count, uint64_t seed, int lo_exp, int span) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
        x[i] = ldexpf(1.0f, lo_exp + (int)(mix64(seed + 0x9E3779B97F4A7C15ull * (i + 1)) % (uint64_t)span));
}

/* Two bf16 outputs of the same shape: how many elements differ in their bits, how many differ by
 * more than rel·|ref| + abs_floor (NaN counts as both), and the sum of ref². */
struct DiffStats {
    unsigned long long bits_differ, far;
    double sum_sq_ref;
};
__global__ void diff_stats(const uint16_t *__restrict__ x, const uint16_t *__restrict__ ref, size_t count, float rel,
                           float abs_floor, DiffStats *out) {
    unsigned long long differ = 0, far = 0;
    double sum_sq = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        const float fx = __uint_as_float((uint32_t)x[i] << 16), fr = __uint_as_float((uint32_t)ref[i] << 16);
        differ += x[i] != ref[i];
        far += !(fabsf(fx - fr) <= rel * fabsf(fr) + abs_floor);
        sum_sq += (double)fr * fr;
    }
    for (int o = 16; o > 0; o /= 2) {
        differ += __shfl_down_sync(0xFFFFFFFFu, differ, o);
        far += __shfl_down_sync(0xFFFFFFFFu, far, o);
        sum_sq += __shfl_down_sync(0xFFFFFFFFu, sum_sq, o);
    }
    if (threadIdx.x % 32 == 0) {
        atomicAdd(&out->bits_differ, differ);
        atomicAdd(&out->far, far);
        atomicAdd(&out->sum_sq_ref, sum_sq);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* E4M3 on the host (OCP FP8 E4M3, "fn": no infinities, S.1111.111 is NaN, max finite 448).  */

static float e4m3_to_float(uint8_t code) {
    const int e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) return NAN;
    const float mag = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);  // (1 + m/8)·2^(e-7)
    return (code & 0x80) ? -mag : mag;
}

/* The code of a non-negative value that E4M3 represents exactly. */
static uint8_t e4m3_code_of_exact(double v) {
    if (v == 0.0) return 0;
    if (v < 0x1p-6) return (uint8_t)(v * 0x1p9);  // subnormal: m·2^-9
    int e;
    const double f = std::frexp(v, &e);           // v = 2f · 2^(e-1), 2f in [1, 2)
    return (uint8_t)(((e - 1 + 7) << 3) | (int)((2.0 * f - 1.0) * 8.0));
}

/* Round to nearest even, saturating to ±448 (__NV_SATFINITE), NaN to 0x7F. */
static uint8_t e4m3_from_float(float x) {
    if (std::isnan(x)) return 0x7F;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs((double)x);
    if (a >= 448.0) return sign | 0x7E;  // 448 and everything above rounds (or saturates) to 448
    int e;
    std::frexp(a, &e);                              // a in [2^(e-1), 2^e)
    const int grid_exp = std::max(e - 1, -6) - 3;   // 3 fraction bits; below 2^-6 the subnormal grid 2^-9
    const double q = std::nearbyint(std::ldexp(a, -grid_exp));  // exact scaling; rounds to even
    return sign | e4m3_code_of_exact(std::ldexp(q, grid_exp));
}

/* 2^ceil(log2(amax / 448)): the power-of-two scale that brings the block's largest magnitude to at
 * most 448 (1 for an all-zero block). */
static float pow2_scale_for(float amax) {
    if (!(amax > 0.0f)) return 1.0f;
    int e;
    const double f = std::frexp((double)amax / 448.0, &e);  // amax/448 = f·2^e, f in [0.5, 1)
    return (float)std::ldexp(1.0, f == 0.5 ? e - 1 : e);
}

static uint16_t bf16_bits_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (std::isnan(f)) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float bf16_bits_to_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* This program's decoder against cuda_fp8.h's: every code. */
static bool check_decode() {
    int bad_decode = 0;
    for (int c = 0; c < 256; ++c) {
        const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3);
        const float theirs = __half2float(__half(h)), mine = e4m3_to_float((uint8_t)c);
        const bool same = (std::isnan(theirs) && std::isnan(mine)) ||
                          (theirs == mine && std::signbit(theirs) == std::signbit(mine));
        if (!same) {
            if (bad_decode < 4) fprintf(stderr, "decode 0x%02x: cuda_fp8 %g, here %g\n", c, theirs, mine);
            ++bad_decode;
        }
    }
    printf("%s  E4M3 decode of all 256 codes against cuda_fp8.h: %d differ\n", bad_decode ? "FAIL" : "ok  ",
           bad_decode);
    return bad_decode == 0;
}

/* This program's encoder against cuda_fp8.h's: floats over the E4M3 range and beyond (2^-20 ..
 * 2^10, both signs; every 2^13-th significand, which includes every rounding tie, and its two
 * neighbours, the values just off a tie). */
static bool check_encode() {
    long long tried = 0, bad_encode = 0;
    for (int exp = -20; exp <= 10; ++exp)
        for (uint32_t j = 0; j < (1u << 13); ++j)
            for (int d = -1; d <= 1; ++d)
                for (int sign = 0; sign < 2; ++sign) {
                    const uint32_t frac = (j << 10) + (uint32_t)d;
                    if (frac >= (1u << 23)) continue;
                    const uint32_t bits = ((uint32_t)sign << 31) | ((uint32_t)(exp + 127) << 23) | frac;
                    float x;
                    memcpy(&x, &bits, 4);
                    const uint8_t theirs = (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
                    const uint8_t mine = e4m3_from_float(x);
                    ++tried;
                    if (theirs != mine) {
                        if (bad_encode < 4) fprintf(stderr, "encode %a: cuda_fp8 0x%02x, here 0x%02x\n", x, theirs, mine);
                        ++bad_encode;
                    }
                }
    printf("%s  E4M3 encode (RNE, saturating) of %lld floats against cuda_fp8.h: %lld differ\n",
           bad_encode ? "FAIL" : "ok  ", tried, bad_encode);
    return bad_encode == 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Operands and launches.                                                                     */

static int scale_rows_ld(int M) { return (M + 3) / 4 * 4; }  // TMA: row strides of 16 bytes
static int scale_blocks_ld(int N) { return ((N + SCALE_BLOCK - 1) / SCALE_BLOCK + 3) / 4 * 4; }

/* One problem's device operands: codes A [M, K], B [N, K]; scales sa [K/128][ld_sa],
 * sb [K/128][ld_nb] (ld_sa = scale_rows_ld(M), ld_nb = scale_blocks_ld(N)). */
struct Fp8Operands {
    const uint8_t *A, *B;
    const float *sa, *sb;
};

/* K-major codes [rows, K] as a 2-D tensor map, box [box_rows, 128], 128B swizzle. */
static CUtensorMap make_code_map(const uint8_t *ptr, int rows, int K, int box_rows, const char *what) {
    CHECK(((uintptr_t)ptr & 15) == 0, "%s: base address must be 16-byte aligned", what);
    CUtensorMap map;
    memset(&map, 0, sizeof(map));
    const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)K};
    const cuuint32_t box[2] = {(cuuint32_t)FP8_BK, (cuuint32_t)box_rows};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult r = g_encode_tiled(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t *>(ptr), dims, strides,
                                      box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled(%s: rows %d, K %d, box %d x %d) failed with CUresult %d", what,
          rows, K, box_rows, FP8_BK, (int)r);
    return map;
}

/* fp32 scales [num_kb][ld] (the first `cols` of each row used) as a 2-D tensor map, box [1, box_cols].
 * Every load from it must start at an inner coordinate that is a multiple of 4 (the TMA rule). */
static CUtensorMap make_scale_map(const float *ptr, int cols, int ld, int num_kb, int box_cols, const char *what) {
    CHECK(((uintptr_t)ptr & 15) == 0 && ld % 4 == 0, "%s: base and row stride must be 16-byte aligned", what);
    CHECK(box_cols % 4 == 0, "%s: box rows must be whole 16-byte units (box %d fp32)", what, box_cols);
    CUtensorMap map;
    memset(&map, 0, sizeof(map));
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)num_kb};
    const cuuint64_t strides[1] = {(cuuint64_t)ld * sizeof(float)};
    const cuuint32_t box[2] = {(cuuint32_t)box_cols, 1};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult r = g_encode_tiled(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float *>(ptr), dims, strides,
                                      box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled(%s: %d x %d, ld %d) failed with CUresult %d", what, num_kb, cols,
          ld, (int)r);
    return map;
}

typedef void (*Fp8Kernel)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, bf16 *, float *, int, int, int, int *);

struct Fp8Variant {
    const char *name;
    int bn;
    Fp8Kernel kernel;
    int smem_bytes;
};

#define FP8_VARIANT(name, bn, arrange) \
    { name, bn, fp8_tile_kernel<bn, arrange>, Fp8Tile<bn>::SMEM_BYTES }
static const Fp8Variant FP8_VARIANTS[] = {
    FP8_VARIANT("128x128 free", 128, ARRANGE_FREE), FP8_VARIANT("128x128 stag", 128, ARRANGE_STAGGERED),
    FP8_VARIANT("128x128 pipe", 128, ARRANGE_PIPELINED),
    FP8_VARIANT("128x192 free", 192, ARRANGE_FREE), FP8_VARIANT("128x192 stag", 192, ARRANGE_STAGGERED),
    FP8_VARIANT("128x256 free", 256, ARRANGE_FREE), FP8_VARIANT("128x256 stag", 256, ARRANGE_STAGGERED),
    FP8_VARIANT("128x256 pipe64", 256, ARRANGE_PIPE64), FP8_VARIANT("128x256 pipe64/K", 256, ARRANGE_PIPE64_BLOCK),
    FP8_VARIANT("128x256 areg", 256, ARRANGE_AREG),
};
#undef FP8_VARIANT
constexpr int NUM_FP8_VARIANTS = sizeof(FP8_VARIANTS) / sizeof(FP8_VARIANTS[0]);

/* Everything one launch needs, built outside any timing loop. */
struct Fp8Launch {
    CUtensorMap a, b, sa, sb;
    int M, N, K, grid;
    const Fp8Variant *v;
};

static Fp8Launch plan_fp8(const Fp8Variant &v, const Fp8Operands &o, const Shape &s) {
    CHECK(s.M >= 1 && s.N >= SCALE_BLOCK && s.K >= FP8_BK, "shape M %d N %d K %d: need M >= 1, N >= 128, K >= 128",
          s.M, s.N, s.K);
    CHECK(s.N % SCALE_BLOCK == 0 && s.K % FP8_BK == 0, "shape M %d N %d K %d: N and K must be multiples of 128", s.M,
          s.N, s.K);
    const long long tiles = (long long)((s.M + BM - 1) / BM) * ((s.N + v.bn - 1) / v.bn);
    CHECK(tiles < (1ll << 31), "too many tiles (%lld)", tiles);
    Fp8Launch l;
    l.a = make_code_map(o.A, s.M, s.K, BM, "A");
    l.b = make_code_map(o.B, s.N, s.K, v.bn, "B");
    l.sa = make_scale_map(o.sa, s.M, scale_rows_ld(s.M), s.K / SCALE_BLOCK, BM, "sa");
    l.sb = make_scale_map(o.sb, s.N / SCALE_BLOCK, scale_blocks_ld(s.N), s.K / SCALE_BLOCK, SB_BOX, "sb");
    l.M = s.M;
    l.N = s.N;
    l.K = s.K;
    l.grid = (int)std::min<long long>(tiles, g_num_sms);
    l.v = &v;
    return l;
}

static void launch_fp8(const Fp8Launch &l, bf16 *C16, float *C32, int *err) {
    l.v->kernel<<<l.grid, THREADS, l.v->smem_bytes>>>(l.a, l.b, l.sa, l.sb, C16, C32, l.M, l.N, l.K, err);
    CUDA_CHECK(cudaGetLastError());
}

struct Bf16Launch {
    CUtensorMap a, b;
    int M, N, K, grid;
};

static Bf16Launch plan_bf16(const bf16 *A, const bf16 *B, const Shape &s) {
    Bf16Launch l;
    l.a = make_kmajor_map(A, s.M, s.K, BM, "A bf16");
    l.b = make_kmajor_map(B, s.N, s.K, Bf16Coop::BN, "B bf16");
    l.M = s.M;
    l.N = s.N;
    l.K = s.K;
    const long long tiles = (long long)((s.M + BM - 1) / BM) * ((s.N + Bf16Coop::BN - 1) / Bf16Coop::BN);
    l.grid = (int)std::min<long long>(tiles, g_num_sms);
    return l;
}

static void launch_bf16(const Bf16Launch &l, bf16 *C, int *err) {
    bf16_coop_kernel<<<l.grid, THREADS, Bf16Coop::SMEM_BYTES>>>(l.a, l.b, C, l.M, l.N, l.K, err);
    CUDA_CHECK(cudaGetLastError());
}

/* ------------------------------------------------------------------------------------------ */
/* Test inputs (host, a pure function of the seed).                                           */

struct Rng {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    double uniform() { return (double)(next() >> 11) * 0x1p-53; }  // [0, 1)
    int below(int n) { return (int)(next() % (uint64_t)n); }
};

enum Tier { TIER_SMALL_INT = 1, TIER_ONE_HOT_B = 2, TIER_ONE_HOT_A = 4, TIER_QUANTISED = 8 };

static const char *tier_name(int tier) {
    return tier == TIER_SMALL_INT   ? "small-int"
           : tier == TIER_ONE_HOT_B ? "one-hot-B"
           : tier == TIER_ONE_HOT_A ? "one-hot-A"
                                    : "quantised";
}

struct HostFp8 {
    std::vector<uint8_t> A, B;   // [M, K], [N, K]
    std::vector<float> sa, sb;   // [K/128][scale_rows_ld(M)], [K/128][scale_blocks_ld(N)]
};

/* A power-of-two scale over 17 binades (2^-8 .. 2^8); one block in 16 an outlier 2^16..2^24 above
 * or below. */
static float random_pow2_scale(Rng &r) {
    const int e = r.below(16) == 0 ? (r.below(2) ? 1 : -1) * (16 + r.below(9)) : -8 + r.below(17);
    return ldexpf(1.0f, e);
}

/* How one 128-block of fp32 test data is drawn: magnitudes 2^(top - spread·u)·(1 + v) (so blocks
 * span 12 binades of scale between them, and a block up to 20 binades inside it, past E4M3's
 * subnormals), random signs, and in one block in 16 one element 2^12 larger than the rest. */
struct BlockDraw {
    int top_exp;
    double spread;
    int outlier;  // index of the outlier element in the block, or -1
};

static BlockDraw random_block_draw(Rng &r, int elements) {
    static const double spreads[] = {1.0, 4.0, 12.0, 20.0};
    BlockDraw d;
    d.top_exp = -6 + r.below(13);
    d.spread = spreads[r.below(4)];
    d.outlier = r.below(16) == 0 ? r.below(elements) : -1;
    return d;
}

static float draw_value(Rng &r, const BlockDraw &d, int index) {
    double mag = std::ldexp(1.0 + r.uniform(), d.top_exp) * std::exp2(-d.spread * r.uniform());
    if (index == d.outlier) mag *= 4096.0;
    return (float)(r.below(2) ? -mag : mag);
}

/* A [M, K] quantised 1x128: per row per K block, scale = pow2_scale_for(amax), code = RNE(x / scale). */
static void quantise_rows(Rng &r, int M, int K, std::vector<uint8_t> &codes, std::vector<float> &scales) {
    const int ld = scale_rows_ld(M);
    std::vector<float> x(SCALE_BLOCK);
    for (int m = 0; m < M; ++m)
        for (int kb = 0; kb < K / SCALE_BLOCK; ++kb) {
            const BlockDraw d = random_block_draw(r, SCALE_BLOCK);
            float amax = 0.0f;
            for (int i = 0; i < SCALE_BLOCK; ++i) {
                x[i] = draw_value(r, d, i);
                amax = std::max(amax, std::fabs(x[i]));
            }
            const float s = pow2_scale_for(amax);
            scales[(size_t)kb * ld + m] = s;
            for (int i = 0; i < SCALE_BLOCK; ++i) codes[(size_t)m * K + kb * SCALE_BLOCK + i] = e4m3_from_float(x[i] / s);
        }
}

/* B [N, K] quantised 128x128: per block, scale = pow2_scale_for(amax), code = RNE(x / scale). */
static void quantise_blocks(Rng &r, int N, int K, std::vector<uint8_t> &codes, std::vector<float> &scales) {
    const int ld = scale_blocks_ld(N);
    std::vector<float> x((size_t)SCALE_BLOCK * SCALE_BLOCK);
    for (int nb = 0; nb < N / SCALE_BLOCK; ++nb)
        for (int kb = 0; kb < K / SCALE_BLOCK; ++kb) {
            const BlockDraw d = random_block_draw(r, SCALE_BLOCK * SCALE_BLOCK);
            float amax = 0.0f;
            for (int i = 0; i < SCALE_BLOCK * SCALE_BLOCK; ++i) {
                x[i] = draw_value(r, d, i);
                amax = std::max(amax, std::fabs(x[i]));
            }
            const float s = pow2_scale_for(amax);
            scales[(size_t)kb * ld + nb] = s;
            for (int i = 0; i < SCALE_BLOCK * SCALE_BLOCK; ++i)
                codes[(size_t)(nb * SCALE_BLOCK + i / SCALE_BLOCK) * K + kb * SCALE_BLOCK + i % SCALE_BLOCK] =
                    e4m3_from_float(x[i] / s);
        }
}

/* codes in {±1, ±2, ±3}: every partial sum an integer below 2^11, exact on the tensor cores. */
static void small_int_codes(Rng &r, std::vector<uint8_t> &codes) {
    static const float values[] = {1.0f, 2.0f, 3.0f};
    for (uint8_t &c : codes) c = e4m3_from_float(r.below(2) ? -values[r.below(3)] : values[r.below(3)]);
}

/* one 1.0 per row per K block, at the column of the row's index mod 128 (zeros elsewhere). */
static void one_hot_codes(int rows, int K, std::vector<uint8_t> &codes) {
    const uint8_t one = e4m3_from_float(1.0f);
    for (int row = 0; row < rows; ++row)
        for (int k = 0; k < K; ++k) codes[(size_t)row * K + k] = k % SCALE_BLOCK == row % SCALE_BLOCK ? one : 0;
}

static void random_scales(Rng &r, std::vector<float> &scales) {
    for (float &s : scales) s = random_pow2_scale(r);
}

static HostFp8 make_test_data(int tier, const Shape &s, uint64_t seed) {
    Rng r = {seed};
    HostFp8 h;
    h.A.resize((size_t)s.M * s.K);
    h.B.resize((size_t)s.N * s.K);
    h.sa.assign((size_t)(s.K / SCALE_BLOCK) * scale_rows_ld(s.M), 1.0f);
    h.sb.assign((size_t)(s.K / SCALE_BLOCK) * scale_blocks_ld(s.N), 1.0f);
    switch (tier) {
    case TIER_SMALL_INT:
        small_int_codes(r, h.A);
        small_int_codes(r, h.B);
        random_scales(r, h.sa);
        random_scales(r, h.sb);
        break;
    case TIER_ONE_HOT_B:
        quantise_rows(r, s.M, s.K, h.A, h.sa);
        one_hot_codes(s.N, s.K, h.B);
        random_scales(r, h.sb);
        break;
    case TIER_ONE_HOT_A:
        one_hot_codes(s.M, s.K, h.A);
        random_scales(r, h.sa);
        quantise_blocks(r, s.N, s.K, h.B, h.sb);
        break;
    default:
        quantise_rows(r, s.M, s.K, h.A, h.sa);
        quantise_blocks(r, s.N, s.K, h.B, h.sb);
        break;
    }
    return h;
}

/* ------------------------------------------------------------------------------------------ */
/* Self-tests.                                                                                */

/* The bound of the quantised tier, and why: Hopper's FP8 wgmma adds each k32 step's 32 products
 * and the incoming accumulator after aligning them to the largest exponent among them, keeping
 * about 14 bits (DeepSeek-V3's report: "around 14 bits"), i.e. each of those 33 terms loses less
 * than one unit of 2^(e_max - 13), and 2^e_max is at most the block's sum of |products| so far.
 * Four steps per block: |error of a block| < 4 · 34 · 2^-13 · sum |products| (one more unit for
 * the step's own rounding). Promotion adds fp32 rounding (2^-24 relative), far below. A layout or
 * scale bug is caught bit-exactly by the other tiers; this one runs the real-data path and
 * reports how close the hardware comes (the worst error, as a fraction of sum |terms|). */
constexpr double FP8_ACCUM_TOL = 4.0 * 34.0 / 8192.0;
constexpr double BF16_ROUND_REL = 1.0 / 256.0;  // bf16 output: round to nearest, < 2^-8 relative

struct TestBuffers {
    uint8_t *A, *B;
    float *sa, *sb, *decode;
    float *ref32;
    double *ref64, *ref_abs;
    bf16 *C16;
    float *C32;
    size_t c_capacity;  // elements of C16 and C32 (room for the poisoned guard)
    int *err;
};

struct HostRef {
    std::vector<float> ref32;
    std::vector<double> ref64, ref_abs;
};

/* Waits for the launches so far. A CUDA error there (an illegal instruction or address) loses the
 * context, so nothing after it can run: print the check it stopped in, so the log names the
 * kernel and the shape, and exit. */
static void sync_or_exit(const char *what) {
    const cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) return;
    printf("FAIL  %s  %s: %s; the CUDA context is lost, the run stops here (--case / --variant run one check)\n",
           what, cudaGetErrorName(e), cudaGetErrorString(e));
    fflush(stdout);
    exit(2);
}

static HostRef run_fp8_reference(const TestBuffers &b, const HostFp8 &h, const Shape &s, int tier) {
    CUDA_CHECK(cudaMemcpy(b.A, h.A.data(), h.A.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(b.B, h.B.data(), h.B.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(b.sa, h.sa.data(), h.sa.size() * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(b.sb, h.sb.data(), h.sb.size() * sizeof(float), cudaMemcpyHostToDevice));
    const dim3 block(REF_FP8_BLOCK_N, REF_FP8_BLOCK_M);
    const dim3 grid((s.N + REF_FP8_BLOCK_N - 1) / REF_FP8_BLOCK_N, (s.M + REF_FP8_BLOCK_M - 1) / REF_FP8_BLOCK_M);
    reference_fp8_gemm<<<grid, block>>>(b.A, b.B, b.sa, scale_rows_ld(s.M), b.sb, scale_blocks_ld(s.N), b.decode,
                                        b.ref32, b.ref64, b.ref_abs, s.M, s.N, s.K);
    CUDA_CHECK(cudaGetLastError());
    char what[96];
    snprintf(what, sizeof(what), "reference_fp8_gemm M %4d N %4d K %4d %s", s.M, s.N, s.K, tier_name(tier));
    sync_or_exit(what);
    const size_t count = (size_t)s.M * s.N;
    HostRef r;
    r.ref32.resize(count);
    r.ref64.resize(count);
    r.ref_abs.resize(count);
    CUDA_CHECK(cudaMemcpy(r.ref32.data(), b.ref32, count * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(r.ref64.data(), b.ref64, count * sizeof(double), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(r.ref_abs.data(), b.ref_abs, count * sizeof(double), cudaMemcpyDeviceToHost));
    return r;
}

enum CheckResult { CHECK_PASS, CHECK_FAIL, CHECK_KERNEL_ERROR };

/* Runs one variant on the operands in `b` and compares: exact tiers against ref32 (bf16 output:
 * against ref32 rounded to bf16), value for value; the quantised tier against ref64 within
 * FP8_ACCUM_TOL · ref_abs (+ the bf16 rounding). Outputs and a guard after them are poisoned
 * with NaN first; an element still NaN was not written, a guard element changed was written past
 * the end. */
static CheckResult check_fp8(const Fp8Variant &v, const TestBuffers &b, const HostRef &ref, const Shape &s, int tier,
                             bool f32_out) {
    const size_t count = (size_t)s.M * s.N;
    const size_t guard = std::min<size_t>(b.c_capacity - count, 1 << 16);
    const size_t elem = f32_out ? sizeof(float) : sizeof(bf16);
    void *out = f32_out ? (void *)b.C32 : (void *)b.C16;
    CUDA_CHECK(cudaMemset(out, 0xFF, (count + guard) * elem));
    const Fp8Launch l = plan_fp8(v, {b.A, b.B, b.sa, b.sb}, s);
    launch_fp8(l, f32_out ? nullptr : b.C16, f32_out ? b.C32 : nullptr, b.err);
    char what[112];
    snprintf(what, sizeof(what), "fp8 %s M %4d N %4d K %4d %-9s %s", v.name, s.M, s.N, s.K, tier_name(tier),
             f32_out ? "f32 " : "bf16");
    sync_or_exit(what);
    if (!check_kernel_error(b.err, what)) {
        printf("FAIL  %s  kernel error (see stderr)\n", what);
        return CHECK_KERNEL_ERROR;
    }
    std::vector<float> got(count + guard);
    std::vector<uint8_t> raw((count + guard) * elem);
    CUDA_CHECK(cudaMemcpy(raw.data(), out, raw.size(), cudaMemcpyDeviceToHost));
    size_t guard_broken = 0;
    for (size_t i = 0; i < count + guard; ++i) {
        if (f32_out) {
            uint32_t u;
            memcpy(&u, &raw[i * 4], 4);
            memcpy(&got[i], &u, 4);
            if (i >= count && u != 0xFFFFFFFFu) ++guard_broken;
        } else {
            uint16_t u;
            memcpy(&u, &raw[i * 2], 2);
            got[i] = bf16_bits_to_float(u);
            if (i >= count && u != 0xFFFFu) ++guard_broken;
        }
    }
    const bool exact = tier != TIER_QUANTISED;
    size_t bad = 0, unwritten = 0, first_bad = count;
    double worst = 0.0, worst_of_abs = 0.0;  // exact: largest |error|; bound: largest error / bound
    for (size_t i = 0; i < count; ++i) {
        if (std::isnan(got[i])) {
            ++unwritten;
            continue;
        }
        bool ok;
        if (exact) {
            const float want = f32_out ? ref.ref32[i] : bf16_bits_to_float(bf16_bits_rne(ref.ref32[i]));
            ok = got[i] == want;
            worst = std::max(worst, std::fabs((double)got[i] - (double)want));
        } else {
            const double e = std::fabs((double)got[i] - ref.ref64[i]);
            const double accum = FP8_ACCUM_TOL * ref.ref_abs[i];
            const double bound = accum + (f32_out ? 0.0 : BF16_ROUND_REL * (std::fabs(ref.ref64[i]) + accum));
            ok = e <= bound;
            if (bound > 0.0) worst = std::max(worst, e / bound);
            if (ref.ref_abs[i] > 0.0) worst_of_abs = std::max(worst_of_abs, e / ref.ref_abs[i]);
        }
        if (!ok) {
            if (first_bad == count) first_bad = i;
            ++bad;
        }
    }
    const bool pass = bad == 0 && unwritten == 0 && guard_broken == 0;
    if (exact)
        printf("%s  %s  exact: differ %zu  unwritten %zu  past-end %zu  max |diff| %.3g", pass ? "ok  " : "FAIL", what,
               bad, unwritten, guard_broken, worst);
    else
        printf("%s  %s  bound: over %zu  unwritten %zu  past-end %zu  worst %.3f of bound (%.2e of sum|terms|)",
               pass ? "ok  " : "FAIL", what, bad, unwritten, guard_broken, worst, worst_of_abs);
    if (first_bad < count)
        printf("  first at (%zu, %zu): got %.9g want %.9g", first_bad / s.N, first_bad % s.N, got[first_bad],
               exact ? (double)ref.ref32[first_bad] : ref.ref64[first_bad]);
    printf("\n");
    return pass ? CHECK_PASS : CHECK_FAIL;
}

/* The bf16 baseline against gemm_common's fp32 reference (its tolerances). */
static bool check_bf16(const DeviceOperands &d, bf16 *C, size_t c_capacity, float *ref, const Shape &s, int *err) {
    run_reference(d, ref, s);
    const size_t count = (size_t)s.M * s.N, guard = std::min<size_t>(c_capacity - count, 1 << 16);
    CUDA_CHECK(cudaMemset(C, 0xFF, (count + guard) * sizeof(bf16)));
    launch_bf16(plan_bf16(d.A, d.B, s), C, err);
    char what[96];
    snprintf(what, sizeof(what), "bf16 coop 128x256 M %4d N %4d K %4d", s.M, s.N, s.K);
    sync_or_exit(what);
    if (!check_kernel_error(err, what)) {
        printf("FAIL  %s  kernel error (see stderr)\n", what);
        return false;
    }
    const CompareResult c = compare(C, ref, s.M, s.N, guard);
    const bool ok = c.bad == 0 && c.unwritten == 0 && c.guard_broken == 0;
    printf("%s  %s  |err| <= %.0e + %.4f |ref|: bad %zu  unwritten %zu  past-end %zu  max rel %.3e\n",
           ok ? "ok  " : "FAIL", what, ABS_TOL, REL_TOL, c.bad, c.unwritten, c.guard_broken, c.max_rel);
    return ok;
}

/* ------------------------------------------------------------------------------------------ */
/* cuBLASLt FP8 (optional).                                                                   */

#ifdef WITH_CUBLAS
/* C[M, N] row-major = A · B^T said column-major: C^T[N, M] = op_T(B) · A^T, with B as cuBLASLt's
 * A (K x N, ld K, transposed) and A as its B (K x M, ld K): FP8 on Hopper takes only this "TN"
 * form. block_scaled: weights BLK128x128_32F, activations VEC128_32F; their scale layouts as this
 * program reads cuBLASLt's documentation (sb_lt [N/128][round_up(K/128, 4)] with the K blocks
 * contiguous, sa_lt [K/128][M] with M contiguous): the run cross-checks the result against the
 * 128x128 tile and says so if they disagree. Otherwise per-tensor scales of 1 with fast
 * accumulation (no promotion): plain FP8's ceiling. */
struct LtGemm {
    bool ok = false;
    char why[200] = "";
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo;
};

static void lt_destroy(LtGemm &g) {
    if (g.a) cublasLtMatrixLayoutDestroy(g.a);
    if (g.b) cublasLtMatrixLayoutDestroy(g.b);
    if (g.d) cublasLtMatrixLayoutDestroy(g.d);
    if (g.desc) cublasLtMatmulDescDestroy(g.desc);
    g = LtGemm();
}

static LtGemm lt_plan(cublasLtHandle_t h, bool block_scaled, const float *sa_lt, const float *sb_lt, const Shape &s,
                      size_t workspace_bytes) {
    LtGemm g;
    cublasLtMatmulPreference_t pref = nullptr;
#define LT_TRY(call)                                                                                   \
    do {                                                                                               \
        const cublasStatus_t st_ = (call);                                                             \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                                            \
            snprintf(g.why, sizeof(g.why), "%s: status %d", #call, (int)st_);                          \
            if (pref) cublasLtMatmulPreferenceDestroy(pref);                                           \
            return g;                                                                                  \
        }                                                                                              \
    } while (0)
    LT_TRY(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    LT_TRY(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
    LT_TRY(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
    if (block_scaled) {
        const int32_t mode_a = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        LT_TRY(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
        LT_TRY(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb_lt, sizeof(sb_lt)));
        LT_TRY(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
        LT_TRY(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa_lt, sizeof(sa_lt)));
    } else {
        const int8_t fast_accum = 1;
        LT_TRY(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)));
    }
    LT_TRY(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_8F_E4M3, s.K, s.N, s.K));
    LT_TRY(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_8F_E4M3, s.K, s.M, s.K));
    LT_TRY(cublasLtMatrixLayoutCreate(&g.d, CUDA_R_16BF, s.N, s.M, s.N));
    LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                                sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    LT_TRY(cublasLtMatmulAlgoGetHeuristic(h, g.desc, g.a, g.b, g.d, g.d, pref, 1, &result, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0) {
        snprintf(g.why, sizeof(g.why), "no algorithm for this combination");
        return g;
    }
#undef LT_TRY
    g.algo = result.algo;
    g.ok = true;
    return g;
}

static cublasStatus_t lt_run(cublasLtHandle_t h, const LtGemm &g, const uint8_t *A, const uint8_t *B, bf16 *C,
                             void *workspace, size_t workspace_bytes) {
    const float alpha = 1.0f, beta = 0.0f;
    return cublasLtMatmul(h, g.desc, &alpha, B, g.a, A, g.b, &beta, C, g.d, C, g.d, &g.algo, workspace,
                          workspace_bytes, 0);
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* Timings.                                                                                   */

struct Layer {
    const char *name;
    Shape s;
};

/* the routed experts' GEMMs of three layers, 16384 routed rows: gate|up is [M, H] x [2I, H]^T,
 * down [M, I] x [H, I]^T. Then their weight gradients ("wg"), K being an expert's rows (the
 * benchmark's cases: DeepSeek-V3 32 experts and Mixtral 8192 tokens, 2048 rows each; Qwen3 16384
 * tokens, 1024 rows each), as the GEMMs an FP8 weight gradient would run once its operands were
 * quantized along the rows and transposed to K-major: dW_gate|up is [2I, R] x [H, R]^T, dW_down
 * [H, R] x [I, R]^T. Qwen3's stack 8 experts along M to fill the GPU as the pass's concurrent
 * experts do. The tiles scale B per 128 x 128 block where these would scale it per column, one
 * more multiply a promotion. */
static const Layer LAYERS[] = {
    {"dsv3 gate|up", {16384, 4096, 7168}},    {"dsv3 down", {16384, 7168, 2048}},
    {"mixtral gate|up", {16384, 28672, 4096}}, {"mixtral down", {16384, 4096, 14336}},
    {"qwen3 gate|up", {16384, 1536, 2048}},   {"qwen3 down", {16384, 2048, 768}},
    {"dsv3 wg gate|up", {4096, 7168, 2048}},  {"dsv3 wg down", {7168, 2048, 2048}},
    {"mixtral wg g|u", {28672, 4096, 2048}},  {"mixtral wg down", {4096, 14336, 2048}},
    {"qwen3 wg gate|up", {8 * 1536, 2048, 1024}}, {"qwen3 wg down", {8 * 2048, 768, 1024}},
};
constexpr int NUM_LAYERS = sizeof(LAYERS) / sizeof(LAYERS[0]);

static DiffStats diff_bf16(const bf16 *x, const bf16 *ref, size_t count, float rel, float abs_floor, DiffStats *d_stats) {
    CUDA_CHECK(cudaMemset(d_stats, 0, sizeof(DiffStats)));
    diff_stats<<<1024, 256>>>(reinterpret_cast<const uint16_t *>(x), reinterpret_cast<const uint16_t *>(ref), count,
                              rel, abs_floor, d_stats);
    CUDA_CHECK(cudaGetLastError());
    DiffStats h;
    CUDA_CHECK(cudaMemcpy(&h, d_stats, sizeof(h), cudaMemcpyDeviceToHost));
    return h;
}

static double tflops(const Shape &s, double ms) { return ms > 0.0 ? 2.0 * s.M * s.N * (double)s.K / ms * 1e-9 : 0.0; }

/* ------------------------------------------------------------------------------------------ */
/* The self-tests' shapes and the command line.                                               */

struct TestCase {
    Shape s;
    int tiers;
};
constexpr int ALL_TIERS = TIER_SMALL_INT | TIER_ONE_HOT_B | TIER_ONE_HOT_A | TIER_QUANTISED;
/* one tile and one K block; M not a multiple of 128 and N of 192 or 256 (tiles starting on every
   128-column block); one row; several tiles and K blocks not a multiple of the stages; more tiles
   than SMs; DeepSeek's K */
static const TestCase TESTS[] = {
    {{128, 128, 128}, TIER_SMALL_INT | TIER_ONE_HOT_B | TIER_ONE_HOT_A},
    {{77, 384, 256}, ALL_TIERS},
    {{1, 128, 2048}, TIER_SMALL_INT},
    {{300, 640, 768}, ALL_TIERS},
    {{4000, 1536, 1024}, TIER_SMALL_INT | TIER_QUANTISED},
    {{4096, 2048, 7168}, TIER_SMALL_INT | TIER_QUANTISED},
};
constexpr int NUM_TESTS = sizeof(TESTS) / sizeof(TESTS[0]);

/* What one run does: every check and timing (the default), or, to look at one failure alone, the
 * fp8 checks of one test case (--case: no bf16 self-test and no timings, since a tile is timed only
 * once it passed every check) and / or of one fp8 tile (--variant: its checks and timings only). */
struct Options {
    uint64_t seed;
    int only_case;     // index into TESTS, or -1: all
    int only_variant;  // index into FP8_VARIANTS, or -1: all
};

/* A variant's name as printed ("128x128 free"), with '-' accepted for the space, or its index. */
static int find_variant(const char *arg) {
    char *end;
    const long index = strtol(arg, &end, 10);
    if (*arg && *end == 0) return index >= 0 && index < NUM_FP8_VARIANTS ? (int)index : -1;
    for (int vi = 0; vi < NUM_FP8_VARIANTS; ++vi) {
        const char *a = arg, *n = FP8_VARIANTS[vi].name;
        while (*a && *n && (*a == *n || (*a == '-' && *n == ' '))) ++a, ++n;
        if (*a == 0 && *n == 0) return vi;
    }
    return -1;
}

static void usage(const char *program) {
    fprintf(stderr, "usage: %s [seed] [--case I] [--variant NAME|I]  (NAME with '-' for its space)\n  cases:", program);
    for (int i = 0; i < NUM_TESTS; ++i)
        fprintf(stderr, "  %d: M %d N %d K %d", i, TESTS[i].s.M, TESTS[i].s.N, TESTS[i].s.K);
    fprintf(stderr, "\n  variants:");
    for (int vi = 0; vi < NUM_FP8_VARIANTS; ++vi) fprintf(stderr, "  %d: %s", vi, FP8_VARIANTS[vi].name);
    fprintf(stderr, "\n");
    exit(2);
}

static Options parse_options(int argc, char **argv) {
    Options o = {(uint64_t)time(nullptr), -1, -1};
    for (int i = 1; i < argc; ++i) {
        const char *arg = argv[i];
        if (strcmp(arg, "--case") == 0 && i + 1 < argc) {
            char *end;
            const long c = strtol(argv[++i], &end, 10);
            if (*argv[i] == 0 || *end != 0 || c < 0 || c >= NUM_TESTS) {
                fprintf(stderr, "--case %s: must be a test case index, 0 to %d\n", argv[i], NUM_TESTS - 1);
                usage(argv[0]);
            }
            o.only_case = (int)c;
        } else if (strcmp(arg, "--variant") == 0 && i + 1 < argc) {
            o.only_variant = find_variant(argv[++i]);
            if (o.only_variant < 0) {
                fprintf(stderr, "--variant %s: no such fp8 tile\n", argv[i]);
                usage(argv[0]);
            }
        } else if (arg[0] != '-') {
            char *end;
            o.seed = strtoull(arg, &end, 0);
            if (*end != 0) {
                fprintf(stderr, "%s: the seed must be a number\n", arg);
                usage(argv[0]);
            }
        } else {
            usage(argv[0]);
        }
    }
    return o;
}

int main(int argc, char **argv) {
    const Options opt = parse_options(argc, argv);
    CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    CHECK(prop.major == 9 && prop.minor == 0, "%s is sm_%d%d; this program is built for sm_90a (H100/H200) only",
          prop.name, prop.major, prop.minor);
    g_num_sms = prop.multiProcessorCount;
    for (const Fp8Variant &v : FP8_VARIANTS) {
        CHECK((size_t)v.smem_bytes <= prop.sharedMemPerBlockOptin, "%s needs %d bytes of shared memory, the device allows %zu",
              v.name, v.smem_bytes, prop.sharedMemPerBlockOptin);
        CUDA_CHECK(cudaFuncSetAttribute((const void *)v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem_bytes));
    }
    CUDA_CHECK(cudaFuncSetAttribute(bf16_coop_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Bf16Coop::SMEM_BYTES));
    load_driver_entry_points();
    const uint64_t seed = opt.seed;
    printf("device %s, %d SMs, seed %llu\n", prop.name, g_num_sms, (unsigned long long)seed);
    if (opt.only_case >= 0)
        printf("--case %d: the fp8 checks of M %d N %d K %d only (no bf16 self-test, no timings)\n", opt.only_case,
               TESTS[opt.only_case].s.M, TESTS[opt.only_case].s.N, TESTS[opt.only_case].s.K);
    if (opt.only_variant >= 0) printf("--variant: fp8 %s only\n", FP8_VARIANTS[opt.only_variant].name);
    printf("fp8 tiles: 128x128 %d stages %d B, 128x192 %d stages %d B, 128x256 %d stages %d B of shared memory\n",
           Fp8Tile<128>::STAGES, Fp8Tile<128>::SMEM_BYTES, Fp8Tile<192>::STAGES, Fp8Tile<192>::SMEM_BYTES,
           Fp8Tile<256>::STAGES, Fp8Tile<256>::SMEM_BYTES);

    int passed = 0, failed = 0;
    /* A variant is timed only if it passed every check; one whose kernel gave up (a 4 s barrier
       timeout) skips its remaining checks, so that one broken variant costs seconds, not minutes,
       and the others are still timed. */
    bool variant_selected[NUM_FP8_VARIANTS], variant_ok[NUM_FP8_VARIANTS], variant_wedged[NUM_FP8_VARIANTS];
    for (int vi = 0; vi < NUM_FP8_VARIANTS; ++vi) {
        variant_selected[vi] = opt.only_variant < 0 || vi == opt.only_variant;
        variant_ok[vi] = variant_selected[vi];
        variant_wedged[vi] = false;
    }
    printf("\nconversions\n");
    (check_decode() ? passed : failed)++;
    (check_encode() ? passed : failed)++;

    /* Operands of the timings (allocated first: the bf16 self-tests read prefixes of them). */
    size_t a_elems = 0, b_elems = 0, c_elems = 0, sa_elems = 0, sb_elems = 0;
    for (const Layer &l : LAYERS) {
        a_elems = std::max(a_elems, (size_t)l.s.M * l.s.K);
        b_elems = std::max(b_elems, (size_t)l.s.N * l.s.K);
        c_elems = std::max(c_elems, (size_t)l.s.M * l.s.N);
        sa_elems = std::max(sa_elems, (size_t)(l.s.K / SCALE_BLOCK) * scale_rows_ld(l.s.M));
        sb_elems = std::max(sb_elems, (size_t)(l.s.K / SCALE_BLOCK) * scale_blocks_ld(l.s.N));
    }
    const DeviceOperands bf = alloc_operands(a_elems, b_elems, seed);
    uint8_t *tA, *tB;
    float *tsa, *tsb;
    bf16 *tC, *tC_first;
    DiffStats *d_stats;
    int *d_err;
    CUDA_CHECK(cudaMalloc(&tA, a_elems));
    CUDA_CHECK(cudaMalloc(&tB, b_elems));
    CUDA_CHECK(cudaMalloc(&tsa, sa_elems * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&tsb, sb_elems * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&tC, c_elems * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&tC_first, c_elems * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&d_stats, sizeof(DiffStats)));
    CUDA_CHECK(cudaMalloc(&d_err, sizeof(int)));
    CUDA_CHECK(cudaMemset(d_err, 0, sizeof(int)));
    fill_random_e4m3<<<1024, 256>>>(tA, a_elems, seed ^ 0xA5A5A5A5ull);
    fill_random_e4m3<<<1024, 256>>>(tB, b_elems, seed ^ 0x5A5A5A5Aull);
    fill_random_pow2<<<1024, 256>>>(tsa, sa_elems, seed ^ 0x1234567ull, -8, 9);
    fill_random_pow2<<<1024, 256>>>(tsb, sb_elems, seed ^ 0x7654321ull, -8, 9);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    auto free_timing_buffers = [&] {
        free_operands(bf);
        CUDA_CHECK(cudaFree(tA));
        CUDA_CHECK(cudaFree(tB));
        CUDA_CHECK(cudaFree(tsa));
        CUDA_CHECK(cudaFree(tsb));
        CUDA_CHECK(cudaFree(tC));
        CUDA_CHECK(cudaFree(tC_first));
        CUDA_CHECK(cudaFree(d_stats));
        CUDA_CHECK(cudaFree(d_err));
    };

    /* Self-test buffers. */
    const Shape bf16_tests[] = {{300, 520, 1000}, {4096, 2048, 7168}};
    size_t ta = 0, tb = 0, tc = 0, tsa_n = 0, tsb_n = 0;
    for (const TestCase &t : TESTS) {
        ta = std::max(ta, (size_t)t.s.M * t.s.K);
        tb = std::max(tb, (size_t)t.s.N * t.s.K);
        tc = std::max(tc, (size_t)t.s.M * t.s.N);
        tsa_n = std::max(tsa_n, (size_t)(t.s.K / SCALE_BLOCK) * scale_rows_ld(t.s.M));
        tsb_n = std::max(tsb_n, (size_t)(t.s.K / SCALE_BLOCK) * scale_blocks_ld(t.s.N));
    }
    for (const Shape &s : bf16_tests) tc = std::max(tc, (size_t)s.M * s.N);
    TestBuffers tbuf;
    tbuf.c_capacity = tc + (1 << 16);
    CUDA_CHECK(cudaMalloc(&tbuf.A, ta));
    CUDA_CHECK(cudaMalloc(&tbuf.B, tb));
    CUDA_CHECK(cudaMalloc(&tbuf.sa, tsa_n * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&tbuf.sb, tsb_n * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&tbuf.decode, 256 * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&tbuf.ref32, tc * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&tbuf.ref64, tc * sizeof(double)));
    CUDA_CHECK(cudaMalloc(&tbuf.ref_abs, tc * sizeof(double)));
    CUDA_CHECK(cudaMalloc(&tbuf.C16, tbuf.c_capacity * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&tbuf.C32, tbuf.c_capacity * sizeof(float)));
    tbuf.err = d_err;
    {
        float table[256];
        for (int c = 0; c < 256; ++c) table[c] = e4m3_to_float((uint8_t)c);
        CUDA_CHECK(cudaMemcpy(tbuf.decode, table, sizeof(table), cudaMemcpyHostToDevice));
    }

    bool bf16_ok = false;  // the bf16 baseline is timed only if it passed its self-test
    if (opt.only_case < 0) {
        printf("\nbf16 baseline self-test against reference_gemm (fp32)\n");
        bf16_ok = true;
        for (const Shape &s : bf16_tests) {
            const bool ok = check_bf16(bf, tbuf.C16, tbuf.c_capacity, tbuf.ref32, s, d_err);
            bf16_ok = bf16_ok && ok;
            (ok ? passed : failed)++;
        }
    }

    printf("\nfp8 self-tests against reference_fp8_gemm; exact tiers bit for bit, quantised within %.4f sum|terms|%s\n",
           FP8_ACCUM_TOL, " (+ bf16 rounding)");
    for (int case_index = 0; case_index < NUM_TESTS; ++case_index) {
        const TestCase &t = TESTS[case_index];
        if (opt.only_case >= 0 && case_index != opt.only_case) continue;  // the same data as in a full run
        for (int tier = 1; tier <= TIER_QUANTISED; tier <<= 1) {
            if (!(t.tiers & tier)) continue;
            const uint64_t data_seed = seed * 0x100000001B3ull + (uint64_t)(case_index * 16 + tier);
            const HostFp8 h = make_test_data(tier, t.s, data_seed);
            const HostRef ref = run_fp8_reference(tbuf, h, t.s, tier);
            const bool one_hot = tier == TIER_ONE_HOT_A || tier == TIER_ONE_HOT_B;
            for (int vi = 0; vi < NUM_FP8_VARIANTS; ++vi)
                for (int f32_out = 1; f32_out >= (one_hot ? 1 : 0); --f32_out) {
                    if (!variant_selected[vi]) continue;
                    if (variant_wedged[vi]) {
                        printf("FAIL  fp8 %s M %4d N %4d K %4d %-9s %s  skipped: the kernel gave up earlier\n",
                               FP8_VARIANTS[vi].name, t.s.M, t.s.N, t.s.K, tier_name(tier), f32_out ? "f32 " : "bf16");
                        ++failed;
                        continue;
                    }
                    const CheckResult r = check_fp8(FP8_VARIANTS[vi], tbuf, ref, t.s, tier, f32_out);
                    variant_ok[vi] = variant_ok[vi] && r == CHECK_PASS;
                    variant_wedged[vi] = variant_wedged[vi] || r == CHECK_KERNEL_ERROR;
                    (r == CHECK_PASS ? passed : failed)++;
                }
        }
    }
    CUDA_CHECK(cudaFree(tbuf.A));
    CUDA_CHECK(cudaFree(tbuf.B));
    CUDA_CHECK(cudaFree(tbuf.sa));
    CUDA_CHECK(cudaFree(tbuf.sb));
    CUDA_CHECK(cudaFree(tbuf.decode));
    CUDA_CHECK(cudaFree(tbuf.ref32));
    CUDA_CHECK(cudaFree(tbuf.ref64));
    CUDA_CHECK(cudaFree(tbuf.ref_abs));
    CUDA_CHECK(cudaFree(tbuf.C16));
    CUDA_CHECK(cudaFree(tbuf.C32));
    if (opt.only_case >= 0) {
        printf("\nno timings: --case runs part of the checks, and a tile is timed only once it passed all of them\n");
        free_timing_buffers();
        printf("\n%d passed, %d failed\n", passed, failed);
        return failed == 0 ? 0 : 1;
    }
    if (failed) printf("\n%d checks failed: the timings below leave out every tile that failed one\n", failed);

    printf("\ntiming: median of %d runs after %d warm-up runs, CUDA events; random codes (every finite nonzero "
           "E4M3) and power-of-two scales 2^-8..2^0; bf16 operands random in ±[1/16, 1)\n",
           TIMED_RUNS, WARMUP_RUNS);
#ifdef WITH_CUBLAS
    cublasLtHandle_t lt;
    CHECK(cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS, "cublasLtCreate failed");
    const size_t workspace_bytes = 64ull << 20;
    void *workspace;
    float *sb_lt;
    CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
    size_t sb_lt_elems = 0;
    for (const Layer &l : LAYERS)
        sb_lt_elems = std::max(sb_lt_elems, (size_t)(l.s.N / SCALE_BLOCK) * ((l.s.K / SCALE_BLOCK + 3) / 4 * 4));
    CUDA_CHECK(cudaMalloc(&sb_lt, sb_lt_elems * sizeof(float)));
#endif
    /* 0 ms: not timed. The first FP8 tile that passed its checks writes tC_first, the yardstick of
       the bits comparison and of the cuBLASLt block-scaled cross-check. */
    int first_ok = -1;
    for (int vi = NUM_FP8_VARIANTS - 1; vi >= 0; --vi)
        if (variant_ok[vi]) first_ok = vi;
    double ms_bf16[NUM_LAYERS], ms_fp8[NUM_LAYERS][NUM_FP8_VARIANTS], ms_lt_tensor[NUM_LAYERS], ms_lt_block[NUM_LAYERS];
    bool same_bits[NUM_LAYERS];
    for (int li = 0; li < NUM_LAYERS; ++li) {
        const Layer &layer = LAYERS[li];
        const Shape &s = layer.s;
        const size_t count = (size_t)s.M * s.N;
        printf("\n%s: M %d N %d K %d\n", layer.name, s.M, s.N, s.K);
        /* One NVTX range per layer, "layerI", so that Nsight Compute can profile one layer's
           launches: ncu --nvtx --nvtx-include "layerI/" ... */
        char range[16];
        snprintf(range, sizeof range, "layer%d", li);
        nvtxRangePushA(range);
        bool ok = true;
        ms_bf16[li] = 0.0;
        if (bf16_ok) {
            const Bf16Launch lb = plan_bf16(bf.A, bf.B, s);
            ms_bf16[li] = time_median_ms([&] { launch_bf16(lb, tC, d_err); });
            ok = check_kernel_error(d_err, "bf16 coop 128x256 (timing)") && ok;
            printf("  bf16 coop 128x256 %8.3f ms %7.1f TFLOP/s\n", ms_bf16[li], tflops(s, ms_bf16[li]));
        } else {
            printf("  bf16 coop 128x256: not timed (failed its checks)\n");
        }
        const Fp8Operands op = {tA, tB, tsa, tsb};
        same_bits[li] = true;
        for (int vi = 0; vi < NUM_FP8_VARIANTS; ++vi) {
            const Fp8Variant &v = FP8_VARIANTS[vi];
            ms_fp8[li][vi] = 0.0;
            if (!variant_ok[vi]) {
                printf("  fp8 %s: not timed (%s)\n", v.name, variant_selected[vi] ? "failed its checks" : "not selected");
                continue;
            }
            const Fp8Launch l = plan_fp8(v, op, s);
            bf16 *out = vi == first_ok ? tC_first : tC;
            ms_fp8[li][vi] = time_median_ms([&] { launch_fp8(l, out, nullptr, d_err); });
            ok = check_kernel_error(d_err, v.name) && ok;
            printf("  fp8 %s  %8.3f ms %7.1f TFLOP/s", v.name, ms_fp8[li][vi], tflops(s, ms_fp8[li][vi]));
            if (ms_bf16[li] > 0.0) printf("  %.2fx bf16", ms_bf16[li] / ms_fp8[li][vi]);
            if (vi != first_ok) {
                const DiffStats d = diff_bf16(tC, tC_first, count, 0.0f, INFINITY, d_stats);
                same_bits[li] = same_bits[li] && d.bits_differ == 0;
                printf("  bits differ from %s: %llu", FP8_VARIANTS[first_ok].name, d.bits_differ);
            }
            printf("\n");
        }
        ms_lt_tensor[li] = ms_lt_block[li] = 0.0;
#ifdef WITH_CUBLAS
        {
            /* weights' scales for cuBLASLt: [N/128][round_up(K/128, 4)], K blocks contiguous */
            const int num_kb = s.K / SCALE_BLOCK, num_nb = s.N / SCALE_BLOCK, ld_nb = scale_blocks_ld(s.N);
            const int ld_kb = (num_kb + 3) / 4 * 4;
            std::vector<float> sb((size_t)num_kb * ld_nb), sbt((size_t)num_nb * ld_kb, 1.0f);
            CUDA_CHECK(cudaMemcpy(sb.data(), tsb, sb.size() * sizeof(float), cudaMemcpyDeviceToHost));
            for (int kb = 0; kb < num_kb; ++kb)
                for (int nb = 0; nb < num_nb; ++nb) sbt[(size_t)nb * ld_kb + kb] = sb[(size_t)kb * ld_nb + nb];
            CUDA_CHECK(cudaMemcpy(sb_lt, sbt.data(), sbt.size() * sizeof(float), cudaMemcpyHostToDevice));
            CHECK(scale_rows_ld(s.M) == s.M, "cuBLASLt's VEC128 scales are read as [K/128][M]: M %% 4 must be 0");
            for (int block_scaled = 0; block_scaled < 2; ++block_scaled) {
                const char *name = block_scaled ? "cuBLASLt fp8 block-scaled" : "cuBLASLt fp8 tensor-scaled, fast accum";
                LtGemm g = lt_plan(lt, block_scaled, tsa, sb_lt, s, workspace_bytes);
                cublasStatus_t st = g.ok ? lt_run(lt, g, tA, tB, tC, workspace, workspace_bytes) : CUBLAS_STATUS_SUCCESS;
                if (!g.ok || st != CUBLAS_STATUS_SUCCESS) {
                    printf("  %s: not run (%s)\n", name, g.ok ? "cublasLtMatmul failed" : g.why);
                    lt_destroy(g);
                    continue;
                }
                const double ms = time_median_ms([&] { lt_run(lt, g, tA, tB, tC, workspace, workspace_bytes); });
                CUDA_CHECK(cudaDeviceSynchronize());
                (block_scaled ? ms_lt_block : ms_lt_tensor)[li] = ms;
                printf("  %s %8.3f ms %7.1f TFLOP/s", name, ms, tflops(s, ms));
                if (block_scaled && first_ok >= 0) {
                    /* the same function as the 128x128 tile: both round a nearly equal fp32 value to
                       bf16, so they should agree within a few bf16 units */
                    const DiffStats first = diff_bf16(tC, tC_first, count, 0.0f, INFINITY, d_stats);
                    const double rms = std::sqrt(first.sum_sq_ref / (double)count);
                    const DiffStats d = diff_bf16(tC, tC_first, count, 1.0f / 64.0f, (float)(rms / 1024.0), d_stats);
                    printf("  vs %s: %llu of %zu beyond 2^-6 |x| + 2^-10 rms%s", FP8_VARIANTS[first_ok].name, d.far, count,
                           d.far ? "  (they disagree: cuBLASLt's scale layout may not be what this program assumes)"
                                 : "");
                }
                printf("\n");
                lt_destroy(g);
            }
        }
#endif
        nvtxRangePop();
        if (!ok) ++failed;
    }
#ifdef WITH_CUBLAS
    CUDA_CHECK(cudaFree(workspace));
    CUDA_CHECK(cudaFree(sb_lt));
    cublasLtDestroy(lt);
#endif

    printf("\nTFLOP/s (2MNK / median time; 0: not timed); best fp8 / bf16 against the megakernel's goal of 1.6x\n");
    printf("%-16s %8s", "layer", "bf16");
    for (const Fp8Variant &v : FP8_VARIANTS) printf(" %12s", v.name);
    printf(" %9s %9s %9s %9s\n", "best/bf16", "same bits", "Lt tensor", "Lt block");
    for (int li = 0; li < NUM_LAYERS; ++li) {
        const Shape &s = LAYERS[li].s;
        double best = 0.0;
        printf("%-16s %8.1f", LAYERS[li].name, tflops(s, ms_bf16[li]));
        for (int vi = 0; vi < NUM_FP8_VARIANTS; ++vi) {
            printf(" %12.1f", tflops(s, ms_fp8[li][vi]));
            if (ms_fp8[li][vi] > 0.0 && (best == 0.0 || ms_fp8[li][vi] < best)) best = ms_fp8[li][vi];
        }
        printf(" %8.2fx %9s %9.1f %9.1f\n", best > 0.0 ? ms_bf16[li] / best : 0.0, same_bits[li] ? "yes" : "no",
               tflops(s, ms_lt_tensor[li]), tflops(s, ms_lt_block[li]));
    }
#ifndef WITH_CUBLAS
    printf("(cuBLASLt columns empty: built without -DWITH_CUBLAS ... -lcublasLt)\n");
#endif

    free_timing_buffers();
    printf("\n%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
