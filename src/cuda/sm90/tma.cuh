/* tma.cuh — tensor-memory-accelerator loads of K-major GEMM operands (sm_90a): the 2-D tensor maps
 * a pass hands its kernel, their encoding on the host, and the device-side copy.
 *
 * A map views a row-major bf16 matrix [rows, cols] and moves boxes of 64 columns (128 bytes, the
 * 128B swizzle's row) by box_rows rows straight into the swizzled layout of tile_operands.cuh.
 * Boxes past the matrix's last row arrive as zeros. The maps travel as a __grid_constant__ kernel
 * parameter (the TMA unit reads them from parameter space).
 *
 * The encoder comes from the driver through the runtime (cudaGetDriverEntryPoint), so the
 * library does not link libcuda. The tuning knob `tma` (tuning.h) turns TMA off: every operand
 * then goes through the producer warpgroup's cp.async. */
#ifndef MOK_CUDA_TMA_CUH
#define MOK_CUDA_TMA_CUH

#include <cuda.h> /* CUtensorMap and its enums only */
#include <cudaTypedefs.h>
#include <pthread.h>

#include "cuda/backend.cuh"

/* The maps of a pass: activations (read K-major as A, or M/N-major by the weight gradients) and
 * the weights (K-major in the forward, N-major in the dgrad), with 64 x 64 boxes; and the bf16
 * weight gradients the backward stores (routed [E·rows, cols] per matrix, shared [rows, cols]),
 * with 64-column x 128-row boxes, in the order of mok_wgrad_matrix. */
enum {
    MAP_RING_X, MAP_RING_H, MAP_X, MAP_SH_H,                    /* forward */
    MAP_RING_DY, MAP_RING_DGU, MAP_DY, MAP_SH_DGU, MAP_RING_DYW, /* backward */
    MAP_W_GATE, MAP_W_UP, MAP_W_DOWN, MAP_S_GATE, MAP_S_UP, MAP_S_DOWN, /* B */
    MAP_DW_GATE, MAP_DW_UP, MAP_DW_DOWN, MAP_DS_GATE, MAP_DS_UP, MAP_DS_DOWN, /* stores */
    NUM_MAPS
};

struct pass_maps {
    CUtensorMap m[NUM_MAPS];
};

#ifdef __CUDACC__
static __device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

/* One box (c0 along the columns, c1 along the rows) into shared memory; completes its bytes on bar. */
static __device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

/* Stores (the weight gradients). The threads that wrote the box to shared memory fence it for
 * the async proxy and sync; then one thread issues the stores and commits them as a bulk group.
 * Before the shared memory is written again, that thread waits until its groups have read it
 * (wait_group.read); before the kernel ends, until they are done (wait_group). Bulk groups
 * belong to the thread that issued them. */
static __device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, int c0, int c1, uint32_t src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"((uint64_t)map),
                 "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
static __device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
static __device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
static __device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
static __device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
#endif

static PFN_cuTensorMapEncodeTiled_v12000 tma_encode_fn;
static pthread_once_t tma_once = PTHREAD_ONCE_INIT;

static void tma_load_encoder(void) {
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    void *fn = NULL;
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &query);
#else
    cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &query);
#endif
    if (e == cudaSuccess && query == cudaDriverEntryPointSuccess) tma_encode_fn = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    else cudaGetLastError();
}

/* Whether the driver gave the tensor-map encoder. */
static int tma_encoder_found(void) {
    pthread_once(&tma_once, tma_load_encoder);
    return tma_encode_fn != NULL;
}

/* Encodes `map` for bf16 [rows, cols] at ptr with boxes of box_rows x 64. Returns 1 when the map
 * is usable, 0 when the matrix is absent (NULL, no rows), not 16-byte aligned, or the encoder
 * refused it: the tasks reading it then take the cp.async path. */
static int tma_encode(CUtensorMap *map, const void *ptr, long long rows, long long cols, int box_rows) {
    memset(map, 0, sizeof *map);
    if (!tma_encoder_found() || !ptr || rows <= 0 || ((uintptr_t)ptr & 15) || (cols * 2) % 16) return 0;
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
    const cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    const cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = tma_encode_fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)ptr, dims, strides, box, elem_strides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
}

#endif
