/* try.h — for the dev/ programs: TRY(cuda call) prints the failing call with its file, line and
 * error string, and exits with status 1. */
#ifndef MOK_DEV_TRY_H
#define MOK_DEV_TRY_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define TRY(x)                                                                                 \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

#endif
