#!/usr/bin/env bash
# nccl-home.sh — prints the NCCL that PyTorch runs (its nvidia.nccl folder, with include/nccl.h),
# or nothing when python3 has none: the GPU scripts pass it to make as NCCL_HOME, because the
# device API must be compiled against the NCCL that runs (../shared/H200.md).
d=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null) || exit 0
[ -f "$d/include/nccl.h" ] && echo "$d"
exit 0
