#!/usr/bin/env bash
# Many ranks on one GPU: the nvshmem suite (tests/test_shared_gpu.py) under CUDA MPS at DeepEP's
# shapes; the presets nvlink and nvlink-faults run it on the nvlink backend at one node of 8.
# Correctness and memory ordering on the real NVSHMEM runtime, not speed.
#
#   scripts/shared_gpu.sh PART        PART: a preset below (each fits one 10-minute device call)
#   SHAPES=16x8 TESTS="internode" scripts/shared_gpu.sh custom
#   SHAPES=16x8 STEPS=300 scripts/shared_gpu.sh sequence      (a preset at other shapes)
#   VARIANT=tile-reduce scripts/shared_gpu.sh nvlink           (one-node variants, a comma list: bench --variants)
#   SCRIPT="python3 scripts/ll_host_split.py --shared-gpu" scripts/shared_gpu.sh script   (a tool on the bed)
#   RANKS="2 4 8" TOKENS=512 scripts/shared_gpu.sh host   (bench normal's host column beside DeepEP, same run)
#
# Starts the MPS daemon in fresh folders, runs pytest in its own process group with a hard limit,
# and always stops MPS and kills every rank (also after a failure or a hang), so the next run
# finds the GPU free. Logs to $OUT (default ./out); a one-line result per test last.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:-scale}"
backend=nvshmem  # the backend under test (BACKEND=nvlink with custom: one-node shapes only)
case "$part" in
  scale)     shapes="16x8,8x8"; tests="internode or routings or low_latency_sweep or round_trips" ;;
  scale16x2) shapes="16x2"; tests="internode or routings or low_latency_sweep or round_trips" ;;  # 8 nodes of 2
  small)     shapes="2x1,4x2,8x1,8x4"; tests="internode or routings or rounds or low_latency" ;;
  graphs)    shapes="2x1,8x8,16x8"; tests="rounds or graph or autograd" ;;
  fuzz)      shapes="4x2,16x8"; tests="fuzz" ;;
  faults)    shapes="4x2,16x8"; tests="out_of_range or failure_contract or raised_everywhere or skips_a_call or timeout or dead_rank" ;;
  sequence)  shapes="4x2"; tests="random_sequence"; export EPCOMM_SHARED_GPU_STEPS="${STEPS:-1000}" ;;
  engines)   shapes="4x2,8x8"; tests="engines or dropped_unevenly" ;;
  # the nvlink backend at one node of 8 (its workspace in NVSHMEM's mapping: ranks share the GPU);
  # with fewer programs per rank than nvshmem (docs/notes/multinode-log.md, finding 14)
  nvlink)    shapes="8x8"; backend=nvlink
             tests="peer_loads or internode or routings or rounds or low_latency_sweep or graph or autograd or round_trips or stage_in_one_launch or expert_major or beside_deep_ep or handles_equal_deep_eps" ;;
  nvlink-faults) shapes="8x8"; backend=nvlink
             tests="engines or dropped or fuzz or out_of_range or failure_contract or raised_everywhere or random_sequence or skips_a_call or timeout or dead_rank" ;;
  custom)    shapes="${SHAPES:?SHAPES=RxK,...}"; tests="${TESTS:?TESTS=a pytest -k expression}" ;;
  # a tool's command under the same MPS daemon, limit and clean-up (its ranks on GPU 0: --shared-gpu;
  # a Buffer's automatic backend there is nvshmem: EPCOMM_BACKEND=nvlink for the one-node kernels)
  script)    shapes="-"; tests="-"; command="${SCRIPT:?SCRIPT=a command whose ranks share GPU 0}" ;;
  # the one-node calls' host time per call beside DeepEP's (where its wheel was carried), same run:
  # a host cost where a call does not wait for the GPU (cached, combine, num_worst eager; the full
  # dispatch's host holds its count wait on the shared SMs). DeepEP waits for all its programs at
  # once, so at 8 ranks both take Config(8) (8 x 24 programs would not fit one GPU).
  host)      shapes="-"; tests="-"
             command='for R in '"${RANKS:-2 4 8}"'; do sms=24; [ "$R" -gt 4 ] && sms=8
               EPCOMM_BACKEND=nvlink python3 -m epcomm bench normal --shared-gpu --ranks "$R" --sms "$sms" \
                 --tokens '"${TOKENS:-512}"' --extra-tokens "" ${EPCOMM_PEER_CARRIED:+--peer deep_ep} \
                 --out "$OUT/host_r$R" || exit $?; done' ;;
  *) echo "shared_gpu.sh: unknown part '$part' (scale, scale16x2, small, graphs, fuzz, faults, sequence, engines," \
          "nvlink, nvlink-faults, custom, script, host)" >&2; exit 2 ;;
esac
shapes="${SHAPES:-$shapes}"  # a preset's tests at other shapes: SHAPES=16x8 STEPS=300 scripts/shared_gpu.sh sequence
backend="${BACKEND:-$backend}"
if [ -n "${VARIANT:-}" ] && [ "$backend" != nvlink ]; then  # (nvshmem would run its defaults under that name)
  echo "shared_gpu.sh: VARIANT=$VARIANT is a one-node normal-mode variant: it needs the nvlink backend" >&2; exit 2
fi
what="shared-gpu part=$part backend=$backend${VARIANT:+ variant=$VARIANT} shapes=$shapes tests=[$tests]"
runs_command=""; case "$part" in script|host) runs_command=1 ;; esac  # (a command, not pytest)
[ -n "$runs_command" ] && what="shared-gpu part=$part command=[$command]"
if [ -n "${DRY_RUN:-}" ]; then echo "$what"; exit 0; fi  # (what would run)
limit_s="${LIMIT_S:-540}"
# a job still running after this long prints every rank's Python stack (a hang shows where it waits)
export EPCOMM_STACK_DUMP_S="${EPCOMM_STACK_DUMP_S:-200}"
# the checkout on the path, NVLink multicast off, $OUT; DeepEP V1 where its wheel was carried into
# .peers/ (the bench point beside it: tests/peer_cases.py; skipped without it)
source scripts/gpu_env.sh
use_peer
export OUT  # (a command part's child writes there)
export NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=1 EPCOMM_SHARED_GPU=1 EPCOMM_SHARED_GPU_SHAPES="$shapes" \
  EPCOMM_SHARED_GPU_BACKEND="$backend" EPCOMM_SHARED_GPU_VARIANT="${VARIANT:-}"
mps="/tmp/epcomm-mps-$$"
export CUDA_MPS_PIPE_DIRECTORY="$mps/pipe" CUDA_MPS_LOG_DIRECTORY="$mps/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
tests_pgid=""
stop() {
  [ -n "$tests_pgid" ] && kill -KILL -- "-$tests_pgid" 2>/dev/null
  echo quit | nvidia-cuda-mps-control 2>/dev/null
  sleep 1
  cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$OUT/mps_control_$part.log" 2>/dev/null
  rm -rf "$mps"
}
trap stop EXIT
nvidia-cuda-mps-control -d || { echo "shared_gpu.sh: could not start CUDA MPS" >&2; exit 1; }
echo "$what limit=${limit_s}s"
started=$(date +%s)
if [ -n "$runs_command" ]; then
  setsid timeout -k 10 "$limit_s" bash -c "$command" >"$OUT/shared_gpu_$part.log" 2>&1 &
else
  setsid timeout -k 10 "$limit_s" python3 -m pytest -q -s -rA --durations=0 -p no:cacheprovider \
    tests/test_shared_gpu.py -k "$tests" >"$OUT/shared_gpu_$part.log" 2>&1 &
fi
tests_pgid=$!
wait "$tests_pgid"; rc=$?
echo "--- shared-gpu $part: rc=$rc in $(( $(date +%s) - started )) s (124: hit the ${limit_s} s limit)"
if [ "$part" = host ]; then  # every group size's table once (the bench prints each as measured, then again;
  # its every-rank lines, with "|", stay in the log), each with its own header and checks
  grep -E "^# epcomm bench|^call |^(dispatch|combine|get_dispatch_layout)[ ,]|^checks|Error" "$OUT/shared_gpu_$part.log" |
    grep -v "|" | awk '/^# epcomm bench/ && $0 != table { delete seen; table = $0 } !seen[$0]++'; exit "$rc"
fi
if [ -n "$runs_command" ]; then tail -n 60 "$OUT/shared_gpu_$part.log"; exit "$rc"; fi
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^R=|passed|failed|median ms" "$OUT/shared_gpu_$part.log" | cut -c1-400 | tail -40
exit "$rc"
