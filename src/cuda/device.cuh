/* device.cuh — the device helpers every kernel of the cuda backend uses: loads and stores with a
 * memory order, the global timer that bounds every wait, and fp32 -> bf16 packing.
 *
 * NOTE (memory order): within a GPU a producer CTA writes its rows, bar.syncs, and one thread
 * makes a gpu-scope release add on the counter; a consumer thread reads it with a gpu-scope
 * acquire load (or spins relaxed and ends with a gpu-scope acquire fence), then bar.syncs before the CTA reads the rows (through L2: ld.global / cp.async.cg, never
 * the non-coherent path). Across GPUs the barrier kernel orders memory (system-scope release
 * stores of the epoch into every peer's flag, system-scope acquire loads of its own), and with a
 * turned transfer (mok_region_layout.turned) the pass's counters too: they live in the window,
 * where peers wait on and bump them, and every release and acquire on them is system-scope
 * (megakernel/counters.cuh: counter_acquire, finish_task). */
#ifndef MOK_CUDA_DEVICE_CUH
#define MOK_CUDA_DEVICE_CUH

#include <stdint.h>

#include "core/portable.h"

#ifdef __CUDACC__
/* 64-bit loads with a memory order. Acquire loads read counters and flags; relaxed ones are for
   spinning: unlike an acquire (a strong load and an invalidation of the SM's whole L1), they leave
   the L1 that the SM's other warps are reading from. A spin that has seen its value ends with
   fence_acq_rel_* instead (a relaxed read followed by the fence is an acquire of what it read). */
#define MOK_LD_U64(name, order)                                                                    \
    static __device__ __forceinline__ unsigned long long name(const unsigned long long *p) {       \
        unsigned long long v;                                                                      \
        asm volatile("ld." order ".global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");          \
        return v;                                                                                  \
    }
MOK_LD_U64(ld_acquire_gpu, "acquire.gpu")
MOK_LD_U64(ld_acquire_sys, "acquire.sys")
MOK_LD_U64(ld_relaxed_gpu, "relaxed.gpu")
MOK_LD_U64(ld_relaxed_sys, "relaxed.sys")
#undef MOK_LD_U64
static __device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
static __device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
static __device__ __forceinline__ void st_release_gpu(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ void st_release_sys(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ void red_release_gpu(unsigned long long *p, unsigned long long v) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ void red_release_sys(unsigned long long *p, unsigned long long v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ void st_relaxed_sys(int *p, int v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ long long globaltimer_ns() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Two fp32 to bf16, packed (lo in bits 0-15), by one cvt.rn.bf16x2.f32: round to nearest even,
 * the bits of mok__bf16_from_f32 for every non-NaN value (subnormals and overflow to Inf
 * included), where that portable code takes ~6 integer instructions per value. A NaN comes out
 * as the canonical quiet NaN 0x7fff (the portable code keeps its sign and top payload bits):
 * NaNs flow through as NaNs (DESIGN §5), their bits are not part of the function. Every
 * epilogue rounds through this. */
static __device__ __forceinline__ uint32_t bf16x2_from_f32(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* Eight fp32 to eight bf16 (one 16-byte chunk), through bf16x2_from_f32. */
static __device__ __forceinline__ int4 bf16x8_from_f32(const float (&f)[8]) {
    return make_int4((int)bf16x2_from_f32(f[0], f[1]), (int)bf16x2_from_f32(f[2], f[3]),
                     (int)bf16x2_from_f32(f[4], f[5]), (int)bf16x2_from_f32(f[6], f[7]));
}
#endif

#endif
