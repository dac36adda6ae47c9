#!/usr/bin/env bash
# liger-env.sh SITE CMD... — runs CMD in the environment LigerCute needs (installed into SITE by
# bench/liger-setup.sh): its packages on PYTHONPATH; its CUDA 12 runtime and TVM-FFI on the library
# path; its NVSHMEM host library preloaded (its device code refuses the older NVSHMEM that `import
# torch` would map first); NVSHMEM and NCCL bootstrapping on the loopback interface of one machine.
# Multicast stays off, as everywhere on the GPU machines.
set -eu
site=$(cd "$1" && pwd)
shift
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=$site/liger_cute_kernels:$site/tvm_ffi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_PRELOAD=$site/liger_cute_kernels/libnvshmem_host.so.3
export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_REMOTE_TRANSPORT=none NCCL_SOCKET_IFNAME=lo
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "$@"
