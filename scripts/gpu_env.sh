# Sourced by the GPU scripts (gpu_check.sh, speed_run.sh, shared_gpu.sh): the checkout's root as
# the working folder, epcomm on the path, NVLink multicast off, $OUT (default ./out) made;
# `use_peer` installs DeepEP V1's wheel where one was carried into .peers/ and sets `peer` to
# (--peer deep_ep) and EPCOMM_PEER_CARRIED=1 (the bed's tests beside DeepEP then fail, not skip,
# where it does not import), else ().
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
peer=()

use_peer() {
  if ls .peers/deep_ep-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --upgrade --no-deps --no-index --target /tmp/peers .peers/deep_ep-*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/peers" EPCOMM_PEER_CARRIED=1 && peer=(--peer deep_ep)
  fi
}
