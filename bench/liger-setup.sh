#!/usr/bin/env bash
# liger-setup.sh BUNDLE SITE — installs the LigerCute peer from BUNDLE (a folder with whl/*.whl,
# lc.tar.xz: the liger_cute_kernels package, nvlibs.tar.xz: its NVSHMEM host libraries and CUDA 12
# runtime) into SITE, with no network. Then `bench/liger-env.sh SITE CMD...` runs CMD with it.
set -eu
bundle=$1
site=$2
mkdir -p "$site"
python3 -m pip install -q --no-index --no-deps --target "$site" "$bundle"/whl/*.whl
# no zstd / xz command is promised on the GPU machine; Python's tarfile reads .tar.xz
python3 - "$bundle" "$site" <<'PY'
import sys, tarfile
bundle, site = sys.argv[1], sys.argv[2]
tarfile.open(f"{bundle}/lc.tar.xz").extractall(site)
tarfile.open(f"{bundle}/nvlibs.tar.xz").extractall(f"{site}/liger_cute_kernels")
PY
echo "LigerCute installed in $site"
