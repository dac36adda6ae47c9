/* ptx.cuh — thin wrappers of the sm_90a instructions the GEMM tile and the compute CTAs use:
 * mbarriers, the async-proxy fence, cp.async, TMA tensor loads and stores with their bulk groups,
 * wgmma (m64n256k16, bf16 in, fp32 accumulators) with its shared-memory descriptors and the
 * accumulator operand lists every wgmma wrapper spells out, setmaxnreg and stmatrix. Each wrapper
 * is one instruction (or a fixed few); what they are used for, and in which order, is
 * gemm_tile.cuh's and the walks'. */
#ifndef MOK_CUDA_SM90_PTX_CUH
#define MOK_CUDA_SM90_PTX_CUH

#include <cuda.h> /* CUtensorMap only */
#include <stdint.h>

#define WGMMA_N256_ACC 128 /* fp32 accumulators per thread of an m64n256 wgmma */

/* ---- mbarriers, fences, cp.async ---------------------------------------------------------- */
static __device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
static __device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
static __device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
/* Arrives on `bar` when every cp.async this thread issued so far has landed. */
static __device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
static __device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
static __device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

static __device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, bool valid) {
    int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
/* One fp32 (4 bytes, through L1: cp.async's .cg takes only 16); zeros where !valid. */
static __device__ __forceinline__ void cp_async_4(uint32_t dst, const void *src, bool valid) {
    int bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
static __device__ __forceinline__ float lds_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
static __device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

/* ---- TMA: tensor loads and stores (the maps: tma.cuh) ---------------------------------------- */
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
static __device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
static __device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
static __device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

/* ---- wgmma -------------------------------------------------------------------------------- */
static __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/* Keeps the compiler from moving accumulator accesses across the asynchronous region. */
static __device__ __forceinline__ void pin_acc(float (&acc)[WGMMA_N256_ACC]) {
#pragma unroll
    for (int i = 0; i < WGMMA_N256_ACC; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

/* Descriptor of a 128B-swizzled operand half at `addr` (1024-byte aligned atoms, base offset 0). */
static __device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}

/* The accumulator operands of a wgmma, 64 (m64n128) or 128 (m64n256) fp32 per thread: %0 .. %63
 * or %0 .. %127 in its text, and their read-write constraints on d[0 ..]. */
#define MOK_WGMMA_R0_63                                                                               \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                           \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                 \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                 \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MOK_WGMMA_R64_127                                                                             \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                 \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                 \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "     \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MOK_WGMMA_D64 "{" MOK_WGMMA_R0_63 "}"
#define MOK_WGMMA_D128 "{" MOK_WGMMA_R0_63 ", " MOK_WGMMA_R64_127 "}"
#define MOK_WGMMA_ACC8(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                             "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MOK_WGMMA_ACC64(d)                                                                            \
    MOK_WGMMA_ACC8(d, 0), MOK_WGMMA_ACC8(d, 8), MOK_WGMMA_ACC8(d, 16), MOK_WGMMA_ACC8(d, 24),         \
        MOK_WGMMA_ACC8(d, 32), MOK_WGMMA_ACC8(d, 40), MOK_WGMMA_ACC8(d, 48), MOK_WGMMA_ACC8(d, 56)
#define MOK_WGMMA_ACC128(d)                                                                           \
    MOK_WGMMA_ACC64(d), MOK_WGMMA_ACC8(d, 64), MOK_WGMMA_ACC8(d, 72), MOK_WGMMA_ACC8(d, 80),          \
        MOK_WGMMA_ACC8(d, 88), MOK_WGMMA_ACC8(d, 96), MOK_WGMMA_ACC8(d, 104), MOK_WGMMA_ACC8(d, 112), \
        MOK_WGMMA_ACC8(d, 120)

/* D[64 x 256] (+)= A[64 x 16] · B[16 x 256], both from shared memory. */
template <int TA, int TB>
static __device__ __forceinline__ void wgmma_m64n256k16(float (&d)[WGMMA_N256_ACC], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\n"
                 "setp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " MOK_WGMMA_D128
                 ", %128, %129, p, 1, 1, %131, %132;\n}\n"
                 : MOK_WGMMA_ACC128(d)
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB)
                 : "memory");
}

/* setmaxnreg: the warpgroup gives registers back (dec) or takes them (inc), REGS per thread. */
template <int REGS>
static __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS>
static __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

/* Four 8 x 8 bf16 matrices into shared memory in one instruction (stmatrix): v[m] is this
 * thread's element pair of matrix m (row lane / 4, columns 2 (lane % 4), +1: the accumulator
 * fragment's layout), and lane L gives the address of row L % 8 of matrix L / 8 (16 bytes). */
static __device__ __forceinline__ void stsm_x4(uint32_t addr, uint32_t v0, uint32_t v1, uint32_t v2, uint32_t v3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v0), "r"(v1),
                 "r"(v2), "r"(v3)
                 : "memory");
}

#endif
