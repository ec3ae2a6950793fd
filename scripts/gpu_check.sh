#!/usr/bin/env bash
# One command on a GPU machine: environment info, the GPU test suite, the demo, then both benchmarks
# and both modes on virtual nodes (tables last). Logs and JSON/PNG go to $OUT (default ./out). If a
# DeepEP wheel was carried into .peers/ (a DeepEP V1 wheel built for the GPU machine), the benchmarks
# run it side by side (--peer deep_ep). Extra arguments go to `epcomm bench normal`.
#
# GPU_CHECK=multinode runs only the multi-node part (the NVSHMEM probe; the nvshmem tests on virtual
# nodes — every GPU its own node, automatic backend — and on loopback ranks; both virtual-node
# benchmarks); GPU_CHECK=one-node only the rest (the demo, the one-node GPU tests, both benchmarks
# beside the peer): the two halves fit one device call each (10 minutes), the whole run does not.
# GPU_CHECK=shared-gpu-PART runs the nvshmem suite with many ranks on this one GPU (CUDA MPS,
# DeepEP's shapes up to 16 ranks; scripts/shared_gpu.sh lists the parts, each one device call).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
part="${GPU_CHECK:-all}"
case "$part" in  # many ranks on one GPU under CUDA MPS: scripts/shared_gpu.sh, one preset per call
  shared-gpu-*) exec scripts/shared_gpu.sh "${part#shared-gpu-}" ;;
esac
use_peer
python3 -m epcomm info 2>&1 | tee "$OUT/info.log"
tests_rc=0 bench_rc=0 ll_rc=0
if [ "$part" = multinode ]; then
  python3 scripts/nvshmem_probe.py 2>&1 | tee "$OUT/nvshmem_probe.log"
  python3 -m pytest -q -m gpu tests/test_gpu.py -k "nvshmem or nodes_" tests/test_nvshmem_loopback.py 2>&1 | tee "$OUT/gpu_tests.log"
  tests_rc=${PIPESTATUS[0]}
else
  python3 -m epcomm demo 2>&1 | tee "$OUT/demo.log"
  if [ "$part" = one-node ]; then
    python3 -m pytest -q -m gpu tests/test_gpu.py -k "not nvshmem and not nodes_" 2>&1 | tee "$OUT/gpu_tests.log"
  else
    python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_nvshmem_loopback.py 2>&1 | tee "$OUT/gpu_tests.log"
  fi
  tests_rc=${PIPESTATUS[0]}
  python3 -m epcomm bench normal "${peer[@]}" --out "$OUT" "$@" 2>"$OUT/bench_progress.log" | tee "$OUT/bench_normal.txt"
  bench_rc=${PIPESTATUS[0]}
  python3 -m epcomm bench low-latency "${peer[@]}" --out "$OUT" 2>"$OUT/bench_ll_progress.log" \
    | tee "$OUT/bench_low_latency.txt"
  ll_rc=${PIPESTATUS[0]}
fi
if [ "$part" = one-node ]; then
  echo "gpu tests rc=$tests_rc bench normal rc=$bench_rc bench low-latency rc=$ll_rc"
  [ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$ll_rc" = 0 ]
  exit
fi
# multi-node on virtual nodes of one GPU each (the nvshmem backend; no DeepEP peer there): normal mode
# with the inter-node rows beside the minimum, low-latency mode beside nvlink on one node
mkdir -p "$OUT/virtual_nodes"
python3 -m epcomm bench normal --ranks-per-node 1 --send-parts 1,4 --p2p 1,0 --out "$OUT/virtual_nodes" 2>"$OUT/bench_vn_progress.log" \
  | tee "$OUT/bench_normal_virtual_nodes.txt"
vn_rc=${PIPESTATUS[0]}
python3 -m epcomm bench low-latency --ranks-per-node 1 --out "$OUT/virtual_nodes" 2>"$OUT/bench_vn_ll_progress.log" \
  | tee "$OUT/bench_low_latency_virtual_nodes.txt"
vn_ll_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc bench normal rc=$bench_rc bench low-latency rc=$ll_rc bench virtual nodes rc=$vn_rc" \
  "low-latency rc=$vn_ll_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$ll_rc" = 0 ] && [ "$vn_rc" = 0 ] && [ "$vn_ll_rc" = 0 ]
