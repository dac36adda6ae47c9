/* core.cuh — the portable core (src/core/*.inc) compiled into a CUDA translation unit, for host
 * and device, with internal linkage (MOK_CORE, core/portable.h): the kernels call these functions
 * inline, which calls into another unit would not allow without relocatable device code. */
#ifndef MOK_CUDA_CORE_CUH
#define MOK_CUDA_CORE_CUH

#include "core/schedule.inc"
#include "core/tasks.inc"

#endif
