"""Host time of a full dispatch with and without ``num_worst_tokens``, a cached one, and one CUDA
graph's replay of the num_worst_tokens dispatch (one rank, one GPU: the host's side only; the
kernels' GPU time per replay is in ``epcomm bench normal``'s "dispatch, num_worst, graph" row).

    python3 scripts/worst_tokens_host.py [tokens]      (default 256; H=2048, top-8 of 256 experts)

Prints µs per call (the least of 5 bursts of 20 calls back to back, the GPU drained between
bursts), each form before and after a graph of the num_worst_tokens dispatch was captured, then a
cProfile of 200 num_worst_tokens dispatches (the functions with the most own time)."""
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def host_us(fn, bursts: int = 5, calls: int = 20) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(bursts):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
        torch.cuda.synchronize()
    return best * 1e6


def main() -> None:
    import epcomm
    from epcomm.tools.bench import _capture
    from epcomm.tools.measure import random_batch
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    T, H, K, E = int(sys.argv[1]) if len(sys.argv) > 1 else 256, 2048, 8, 256
    x, topk, weights = random_batch(T, H, K, E, 0, dev)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 28)
    config = epcomm.Config(24, 8, 256)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, E)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk, topk_weights=weights, config=config)
    handle = buffer.dispatch(x, **args)[4]
    forms = {"full": lambda: buffer.dispatch(x, **args),
             "num_worst_tokens": lambda: buffer.dispatch(x, num_worst_tokens=T, **args),
             "cached": lambda: buffer.dispatch(x, handle=handle, config=config)}
    for name, fn in list(forms.items()) * 2:
        print(f"{name:28s} {host_us(fn):7.1f} µs per call", flush=True)
    graph, _ = _capture(forms["num_worst_tokens"])
    forms["one graph's replay"] = graph.replay
    for name, fn in forms.items():
        print(f"{name + ', after a capture':28s} {host_us(fn):7.1f} µs per call", flush=True)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(200):
        forms["num_worst_tokens"]()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    print(text.getvalue())
    buffer.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
