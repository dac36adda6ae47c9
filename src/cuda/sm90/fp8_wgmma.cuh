/* fp8_wgmma.cuh — the E4M3 wgmma of the FP8 tiles (sm_90a): D[64 x 128] (+)= A[64 x 32] · B[32 x 128]
 * with E4M3 operands from shared memory, both K-major (E4M3 has no transposed form), and fp32
 * accumulators in the layout of the bf16 wgmma's (register 4i + {0, 1}: row lane / 4 of the warp's
 * 16, columns 8i + 2 (lane % 4) + {0, 1}; 4i + {2, 3}: the same 8 rows down). scale_d = 0
 * overwrites D, so a 128-K block's partial sum starts from zero. A second form takes A from
 * registers, loaded by ldmatrix from the same swizzled stage (dev/fp8_tile_probe.cu's `areg` tile;
 * the library's tile reads A from shared memory). dev/fp8_tile_probe.cu measures these very
 * instruction wrappers. */
#ifndef MOK_CUDA_SM90_FP8_WGMMA_CUH
#define MOK_CUDA_SM90_FP8_WGMMA_CUH

#include "cuda/sm90/ptx.cuh" /* the accumulator operand lists */

#include <stdint.h>

#define WGMMA_E4M3_K 32      /* K of one E4M3 wgmma: 32 codes, 32 bytes of a 128-byte swizzle row */
#define WGMMA_N128_ACC 64    /* fp32 accumulators per thread of an m64n128 wgmma */

static __device__ __forceinline__ void wgmma_e4m3_n128(float (&d)[WGMMA_N128_ACC], uint64_t desc_a, uint64_t desc_b,
                                                       int scale_d) {
    asm volatile("{\n.reg .pred p;\n"
                 "setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MOK_WGMMA_D64 ", %64, %65, p, 1, 1;\n}\n"
                 : MOK_WGMMA_ACC64(d)
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d)
                 : "memory");
}

/* The same with A from registers: a[k] holds this thread's A fragment of the 32-deep K step, as
 * ldmatrix.x4 leaves it (fp8_a_fragment). */
static __device__ __forceinline__ void wgmma_e4m3_n128_ra(float (&d)[WGMMA_N128_ACC], const uint32_t (&a)[4],
                                                          uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\n"
                 "setp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MOK_WGMMA_D64
                 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : MOK_WGMMA_ACC64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)
                 : "memory");
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
