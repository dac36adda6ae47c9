/* fp8_wgmma.cuh — the E4M3 wgmma of the FP8 tiles (sm_90a): D[64 x 128] (+)= A[64 x 32] · B[32 x 128]
 * with E4M3 operands from shared memory, both K-major (E4M3 has no transposed form), and fp32
 * accumulators in the layout of the bf16 wgmma's (register 4i + {0, 1}: row lane / 4 of the warp's
 * 16, columns 8i + 2 (lane % 4) + {0, 1}; 4i + {2, 3}: the same 8 rows down). scale_d = 0
 * overwrites D, so a 128-K block's partial sum starts from zero. A second form takes A from
 * registers, loaded by ldmatrix from the same swizzled stage (dev/fp8_tile_probe.cu's `areg` tile;
 * the library's tile reads A from shared memory). Self-contained (no other header of the library),
 * so that dev/fp8_tile_probe.cu measures these very instruction wrappers. */
#ifndef MOK_CUDA_SM90_FP8_WGMMA_CUH
#define MOK_CUDA_SM90_FP8_WGMMA_CUH

#include <stdint.h>

#define WGMMA_E4M3_K 32      /* K of one E4M3 wgmma: 32 codes, 32 bytes of a 128-byte swizzle row */
#define WGMMA_N128_ACC 64    /* fp32 accumulators per thread of an m64n128 wgmma */

static __device__ __forceinline__ void wgmma_e4m3_n128(float (&d)[WGMMA_N128_ACC], uint64_t desc_a, uint64_t desc_b,
                                                       int scale_d) {
#define MOK_E4M3_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                         "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1;\n"
        "}\n"
        : MOK_E4M3_ACC8(0), MOK_E4M3_ACC8(8), MOK_E4M3_ACC8(16), MOK_E4M3_ACC8(24), MOK_E4M3_ACC8(32),
          MOK_E4M3_ACC8(40), MOK_E4M3_ACC8(48), MOK_E4M3_ACC8(56)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d)
        : "memory");
#undef MOK_E4M3_ACC8
}

/* The same with A from registers: a[k] holds this thread's A fragment of the 32-deep K step, as
 * ldmatrix.x4 leaves it (fp8_a_fragment). */
static __device__ __forceinline__ void wgmma_e4m3_n128_ra(float (&d)[WGMMA_N128_ACC], const uint32_t (&a)[4],
                                                          uint64_t desc_b, int scale_d) {
#define MOK_E4M3_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                         "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1;\n"
        "}\n"
        : MOK_E4M3_ACC8(0), MOK_E4M3_ACC8(8), MOK_E4M3_ACC8(16), MOK_E4M3_ACC8(24), MOK_E4M3_ACC8(32),
          MOK_E4M3_ACC8(40), MOK_E4M3_ACC8(48), MOK_E4M3_ACC8(56)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)
        : "memory");
#undef MOK_E4M3_ACC8
}

/* This thread's ldmatrix row within a warpgroup's 64 x 128 half-stage of A (128B swizzle: 128-byte
 * rows, 16-byte chunk c of row r stored at chunk c ^ (r % 8)), as a byte offset whose bits 5-6 hold
 * r % 8 / 2: the row of K step k is then at (half + offset) ^ 32 k (fp8_a_fragment). Lane l
 * addresses row l % 8 of matrix l / 8, the four matrices being the warp's rows 0-7 and 8-15 of
 * codes 0-15, then of codes 16-31: the register layout of an 8-bit wgmma A operand (thread l:
 * rows l / 4 and l / 4 + 8, codes 4 (l % 4) .. + 3 and 16 more). */
static __device__ __forceinline__ uint32_t fp8_a_fragment_offset() {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    const int row = ((threadIdx.x >> 5) & 3) * 16 + (m & 1) * 8 + (lane & 7), x = row & 7;
    return row * 128 + ((((m >> 1) ^ x) & 1) << 4) + ((x >> 1) << 5);
}

/* This thread's A fragment of K step k (32 codes) from the half-stage at `half` (1024-aligned). */
static __device__ __forceinline__ void fp8_a_fragment(uint32_t (&a)[4], uint32_t half, uint32_t offset, int k) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"((half + offset) ^ (uint32_t)(k << 5))
                 : "memory");
}

/* Keeps the compiler from moving accesses of a wgmma's registers across its asynchronous region. */
static __device__ __forceinline__ void pin_partial(float (&d)[WGMMA_N128_ACC]) {
#pragma unroll
    for (int i = 0; i < WGMMA_N128_ACC; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#endif
