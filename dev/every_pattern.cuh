/* every_pattern.cuh — for the dev/ probes that check a conversion against its portable rule on
 * every fp32 value: every_pattern(check) launches check(base, counts, first) over all 2^32 bit
 * patterns (thread i of a launch gets pattern base + i; pattern_partner gives it a second,
 * pseudo-random pattern to test alongside) and brings back the counts the kernel added to and the
 * pattern it recorded first. */
#ifndef MOK_DEV_EVERY_PATTERN_CUH
#define MOK_DEV_EVERY_PATTERN_CUH

#include <stdint.h>

#include "try.h"

#define PATTERN_COUNTS 4

struct pattern_result {
    unsigned long long counts[PATTERN_COUNTS];
    unsigned int first;
};

typedef void (*pattern_check)(uint64_t base, unsigned long long *counts, unsigned int *first);

/* A spread of partner patterns: a multiplicative hash of the thread's index. */
static __device__ inline uint32_t pattern_partner(uint64_t i) { return (uint32_t)(i * 2654435761u + 0x9e3779b9u); }

static pattern_result every_pattern(pattern_check check) {
    unsigned long long *counts;
    unsigned int *first;
    TRY(cudaMalloc(&counts, PATTERN_COUNTS * sizeof *counts));
    TRY(cudaMalloc(&first, sizeof *first));
    TRY(cudaMemset(counts, 0, PATTERN_COUNTS * sizeof *counts));
    TRY(cudaMemset(first, 0, sizeof *first));
    const uint64_t total = 1ull << 32, per_launch = 1ull << 30;
    const int threads = 256;
    for (uint64_t base = 0; base < total; base += per_launch) {
        check<<<(unsigned)(per_launch / threads), threads>>>(base, counts, first);
        TRY(cudaGetLastError());
    }
    TRY(cudaDeviceSynchronize());
    pattern_result r;
    TRY(cudaMemcpy(r.counts, counts, sizeof r.counts, cudaMemcpyDeviceToHost));
    TRY(cudaMemcpy(&r.first, first, sizeof r.first, cudaMemcpyDeviceToHost));
    TRY(cudaFree(counts));
    TRY(cudaFree(first));
    return r;
}

#endif
