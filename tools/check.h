/* check.h — how `mok run --check` judges the library against mok_ref_*: one tolerance per
 * output tensor and precision (the tables in check.c say why each value), and the error of a
 * tensor as max |got - ref| / (atol + rtol * max |ref|), which passes at <= 1. */
#ifndef MOK_TOOLS_CHECK_H
#define MOK_TOOLS_CHECK_H

#include <stdint.h>

typedef enum tools_tensor {
    TOOLS_Y,
    TOOLS_DX,
    TOOLS_D_ROUTER_W,
    TOOLS_DW_GATE,
    TOOLS_DW_UP,
    TOOLS_DW_DOWN,
    TOOLS_DS_GATE,
    TOOLS_DS_UP,
    TOOLS_DS_DOWN,
    TOOLS_NUM_TENSORS
} tools_tensor;

typedef enum tools_dtype { TOOLS_BF16, TOOLS_F32 } tools_dtype;

typedef struct tools_tolerance {
    const char *name;
    double rtol; /* of the tensor's max |ref| */
    double atol; /* floor, for a tensor that is zero or nearly so */
} tools_tolerance;

/* The table a run is judged by: its precision (the FP8 function is compared with the FP8
 * reference) and, for FP8, whether its backend sums a GEMM's 128-K blocks on tensor cores (cuda). */
typedef enum tools_table { TOOLS_TABLE_BF16, TOOLS_TABLE_FP8, TOOLS_TABLE_FP8_TENSOR_CORES } tools_table;
tools_table tools_table_of(int precision, int backend);
const tools_tolerance *tools_tolerance_of(tools_tensor tensor, tools_table table);

typedef struct tools_error {
    double max_abs_error; /* +inf when an element is NaN or infinite on either side */
    double max_abs_ref;
    double normalized;    /* max_abs_error / (atol + rtol * max_abs_ref) */
    int64_t worst_index;  /* element of the largest error; -1 for an empty tensor */
} tools_error;

tools_error tools_compare(tools_tensor tensor, tools_table table, const void *got, tools_dtype got_type,
                          const void *ref, tools_dtype ref_type, int64_t count);

#endif
