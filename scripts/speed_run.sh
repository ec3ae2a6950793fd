#!/usr/bin/env bash
# A multi-GPU lease's speed run beside DeepEP, in parts that each fit one device call. Needs DeepEP
# V1's wheel in .peers/ (carried with the call; without it the tables have no peer column).
#
#   RANKS=4 PARTS="normal low-latency" scripts/speed_run.sh
#
# Parts (each under its own time limit, so a hang costs one part, not the call):
#   normal       epcomm bench normal at T=4096 and 512 beside DeepEP (each point with the full dispatch
#                with num_worst_tokens too, eager and as one CUDA graph's replay), and VARIANTS (a comma list of
#                bench.NORMAL_VARIANTS, joined by + for one point; default all, the newest experiments
#                first, so a part cut by its limit keeps those; VARIANTS= for none) at T=4096, each a
#                table of its own
#   low-latency  epcomm bench low-latency beside DeepEP, with LL_ARGS' experiments as columns
#                (default --two-launch: every call in two launches beside the default; LL_ARGS= for none)
#   profile      the full dispatch's host split (scripts/profile_host.py --full-only; with
#                PROFILE_VARIANTS, a comma list of up to 4 bench variants, also the full and cached
#                dispatch's host time with each beside the defaults, interleaved, and each one's full
#                dispatch on the timeline below; its limit then 240 s by default), every call's
#                host time by function over FUNCTION_CALLS calls (--functions, default 2000; its own
#                log and limit FUNCTIONS_LIMIT_S, default 180 s; it does not fail the part) and both
#                libraries on one timeline (scripts/profile_timeline.py), at TOKENS (default 512)
#   trace        the pulls' items on the kernel clock (scripts/trace_items.py): a full dispatch's pull
#                in turn beside a cached dispatch's one launch, and the full dispatch with each of
#                TRACE_VARIANTS (a comma list of bench variants, default none), per rank, at TRACE_TOKENS
#                (default 4096)
#   ll-gaps      the eager low-latency round trip per rank (scripts/ll_back_to_back.py): host and gpu
#                per round trip and the kernels' busy and idle time, eager and in one CUDA graph, for
#                LL_ORDER (default epcomm,two-launch,deep_ep,epcomm,deep_ep; deep_ep needs the wheel)
#   ll-host      the eager low-latency calls' host time by part, per rank, beside DeepEP's whole calls
#                (scripts/ll_host_split.py: the front end, the launch, the allocations, the backend's
#                other Python; which calls run slow)
#   suite        the one-node GPU tests (nvlink) at RANKS ranks, one per GPU, each named as it passes
#                (a part cut by its limit still says which ran); SUITE_K: a pytest -k
#                expression to run part of them
# NORMAL_ARGS: further options of `epcomm bench normal`, split on spaces ("--tokens 512 --extra-tokens
# 4096": T=512 first; "--extra-tokens 4096": T=4096 alone — an empty '' does not survive the split).
# Every table is also printed as it is measured (bench_*_progress.log), so a part cut by its limit
# keeps the tables it finished. Logs under $OUT (default ./out); the tables come last.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
for part in ${PARTS:-normal low-latency}; do  # (a misspelt part: an error before any work)
  case "$part" in normal|low-latency|profile|trace|ll-gaps|ll-host|suite) ;;
    *) echo "speed_run.sh: unknown part '$part' (normal, low-latency, profile, trace, ll-gaps, ll-host, suite)" >&2; exit 2 ;;
  esac
done
use_peer
ranks="${RANKS:-4}"
gpus="${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((ranks - 1)))}"  # (the profile and the suite use all they see)
variants="${VARIANTS-notify-apart,small-one-launch,pulled-lists,full-one-launch,stage-1x,full-one-launch+pull-1x,pull-1x,side-loads-after,single-push,gathered-index,rank-order,serial-combine,serial-dispatch,doorbell-dispatch,pipelined-pull,tile-reduce,reduce-warps-apart}"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
summary=()
for part in ${PARTS:-normal low-latency}; do
  started=$SECONDS
  case "$part" in
    normal)
      timeout -k 10 "${NORMAL_LIMIT_S:-360}" python3 -m epcomm bench normal --ranks "$ranks" ${peer[@]+"${peer[@]}"} \
        ${variants:+--variants "$variants"} ${NORMAL_ARGS:-} --out "$OUT" 2>"$OUT/bench_normal_progress_r$ranks.log" \
        | tee "$OUT/bench_normal_r$ranks.txt" ;;
    low-latency)
      timeout -k 10 "${LL_LIMIT_S:-180}" python3 -m epcomm bench low-latency --ranks "$ranks" ${peer[@]+"${peer[@]}"} \
        ${LL_ARGS---two-launch} --out "$OUT" 2>"$OUT/bench_ll_progress_r$ranks.log" \
        | tee "$OUT/bench_ll_r$ranks.txt" ;;
    profile)
      host_limit="${PROFILE_LIMIT_S:-$([ -n "${PROFILE_VARIANTS:-}" ] && echo 240 || echo 120)}"  # (variants: a Buffer each)
      mkdir -p /tmp/timeline  # (the Chrome traces stay on the machine: $OUT brings back 8 files at most)
      CUDA_VISIBLE_DEVICES="$gpus" timeout -k 10 "$host_limit" \
        python3 scripts/profile_host.py "${TOKENS:-512}" --full-only ${PROFILE_VARIANTS:+--variants "$PROFILE_VARIANTS"} 2>&1 \
        | tee "$OUT/profile_host_r$ranks.txt"
      host_rc=${PIPESTATUS[0]}
      CUDA_VISIBLE_DEVICES="$gpus" timeout -k 10 "${FUNCTIONS_LIMIT_S:-180}" \
        python3 scripts/profile_host.py "${TOKENS:-512}" --functions "${FUNCTION_CALLS:-2000}" \
        >"$OUT/profile_functions_r$ranks.txt" 2>&1 || echo "profile_host.py --functions: rc=$? (its log: $OUT)"
      CUDA_VISIBLE_DEVICES="$gpus" timeout -k 10 "${PROFILE_LIMIT_S:-120}" \
        python3 scripts/profile_timeline.py ${peer[@]+"${peer[@]}"} --tokens "${TOKENS:-512}" --out /tmp/timeline \
        ${PROFILE_VARIANTS:+--variants "$PROFILE_VARIANTS"} 2>&1 \
        | tee "$OUT/profile_timeline_r$ranks.txt" | tail -n 40
      (exit $(( host_rc ? host_rc : PIPESTATUS[0] ))) ;;
    trace)
      CUDA_VISIBLE_DEVICES="$gpus" timeout -k 10 "${TRACE_LIMIT_S:-200}" \
        python3 scripts/trace_items.py --tokens "${TRACE_TOKENS:-4096}" --ranks "$ranks" \
        --variants "${TRACE_VARIANTS:-}" 2>&1 \
        | tee "$OUT/trace_items_r$ranks.txt" | tail -n $((3 * ranks + 4)) ;;
    ll-gaps)
      order="${LL_ORDER:-epcomm,two-launch,deep_ep,epcomm,deep_ep}"
      [ -n "${peer[*]:-}" ] || order="$(echo "$order" | tr ',' '\n' | grep -v '^deep_ep' | paste -sd, -)"
      CUDA_VISIBLE_DEVICES="$gpus" timeout -k 10 "${LL_GAPS_LIMIT_S:-150}" \
        python3 scripts/ll_back_to_back.py --order "$order" 2>&1 | grep -v -i "warn" \
        | tee "$OUT/ll_gaps_r$ranks.txt" | tail -n $((2 * $(echo "$order" | tr ',' '\n' | wc -l) + 2)) ;;
    ll-host)
      CUDA_VISIBLE_DEVICES="$gpus" timeout -k 10 "${LL_HOST_LIMIT_S:-120}" \
        python3 scripts/ll_host_split.py --ranks "$ranks" ${peer[@]+"${peer[@]}"} 2>&1 | grep -v -i "warn" \
        | tee "$OUT/ll_host_r$ranks.txt" | tail -n $((8 * ranks + 2)) ;;
    suite)
      CUDA_VISIBLE_DEVICES="$gpus" EPCOMM_GPU_WORLD_SIZES="$ranks" \
        timeout -k 10 "${SUITE_LIMIT_S:-300}" python3 -m pytest -v -m gpu tests/test_gpu.py \
        -k "not nvshmem and not nodes_${SUITE_K:+ and ($SUITE_K)}" 2>&1 \
        | tee "$OUT/one_node_suite_r$ranks.log" | tail -n 3 ;;
  esac
  part_rc=${PIPESTATUS[0]}
  [ "$part_rc" = 0 ] || failed=1
  summary+=("$part rc=$part_rc ($((SECONDS - started)) s)")
done
printf '%s\n' "${summary[@]}"
exit "${failed:-0}"
