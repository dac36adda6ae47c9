/* tma.cuh — the tensor maps of the tensor memory accelerator (sm_90a): the 2-D maps a pass hands
 * its kernel and their encoding on the host (the device's loads and stores through them:
 * ptx.cuh).
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
 * with 64-column x 128-row boxes, in the order of mok_wgrad_matrix. An FP8 backward reads E4M3
 * rows as A from the maps after those (backward_fp8.cuh: x^ for the replay, dg^|du^ for the dx
 * tiles, the shared expert's dy^ and dg^|du^) and the transposed gate and up weights as the dx
 * tiles' B, each map's rows `row_bytes` apart (tma_encode_rows). */
enum {
    MAP_RING_X, MAP_RING_H, MAP_X, MAP_SH_H, MAP_CTX, MAP_SH_CTX, /* forward (the contexts: stores) */
    MAP_RING_DY, MAP_RING_DGU, MAP_DY, MAP_SH_DGU, MAP_RING_DYW, /* backward */
    MAP_W_GATE, MAP_W_UP, MAP_W_DOWN, MAP_S_GATE, MAP_S_UP, MAP_S_DOWN, /* B */
    MAP_DW_GATE, MAP_DW_UP, MAP_DW_DOWN, MAP_DS_GATE, MAP_DS_UP, MAP_DS_DOWN, /* stores */
    MAP_RING_XQ, MAP_RING_GQ, MAP_SH_DYQ, MAP_SH_GQ, MAP_W_GATE_T, MAP_W_UP_T, /* FP8 backward */
    NUM_MAPS
};

struct pass_maps {
    CUtensorMap m[NUM_MAPS];
};

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

/* Encodes `map` for bf16 [rows, cols] at ptr, row r at ptr + r * row_bytes, with boxes of
 * box_rows x 64. Returns 1 when the map is usable, 0 when the matrix is absent (NULL, no rows),
 * not 16-byte aligned, or the encoder refused it: the tasks reading it then take the cp.async
 * path. */
static int tma_encode_rows(CUtensorMap *map, const void *ptr, long long rows, long long cols, long long row_bytes,
                           int box_rows) {
    memset(map, 0, sizeof *map);
    if (!tma_encoder_found() || !ptr || rows <= 0 || ((uintptr_t)ptr & 15) || row_bytes % 16 || row_bytes < cols * 2)
        return 0;
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)row_bytes};
    const cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    const cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = tma_encode_fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)ptr, dims, strides, box, elem_strides,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
}

/* The same for rows stored back to back. */
static int tma_encode(CUtensorMap *map, const void *ptr, long long rows, long long cols, int box_rows) {
    return tma_encode_rows(map, ptr, rows, cols, cols * 2, box_rows);
}

#endif
