#!/usr/bin/env bash
# Sweep the copy kernels' tile size and warps: cached dispatch + combine at T=4096, 24 SMs.
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for tile in ${TILES:-4096 8192 16384}; do for warps in ${WARPS:-8 16 32}; do
  echo "tile=$tile warps=$warps"
  EPCOMM_COPY_TILE_WORDS=$tile EPCOMM_COPY_WARPS=$warps python3 -m epcomm bench normal --sms 24 --token-sweep "" \
    --reps 10 --out /tmp/tune 2>/dev/null | tail -2 | head -1
done; done
