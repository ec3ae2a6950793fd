"""Where the host time of each call goes (rank 0): primitive costs, then each call split into its
front end (Buffer), the backend's glue and its kernel launches.

Run on a GPU machine: ``python3 scripts/profile_host.py [tokens]``. Host cost is the risk of a
Python design (docs/PERFORMANCE.md); this shows which Python lines a call spends it on.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def _per_call_us(fn, n=2000, burst=40):
    """Host µs per call: the least over bursts of ``burst`` calls, the GPU drained between bursts
    (not timed). A burst never fills the launch queue, so a call slower on the GPU than on the host
    still shows its host cost; the least, because a shared host's interference only adds time."""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(max(1, n // burst)):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(burst):
            fn()
        per_call.append((time.perf_counter() - started) / burst)
    torch.cuda.synchronize()
    return min(per_call) * 1e6


def _breakdown(fn, backend, method: str, n: int = 400):
    """(full, backend, launches, number of launches), µs per call: ``fn`` timed as it is; the
    backend's ``method`` and the kernel launches of one call recorded, then each replayed alone."""
    from epcomm.backends.gpu.launch import BoundKernel
    recorded_call, recorded_launches = [], []
    original_method = getattr(backend, method)
    original_launch = BoundKernel.launch

    def record_call(*args, **kwargs):
        recorded_call.append((args, kwargs))
        return original_method(*args, **kwargs)

    def record_launch(self, *args):
        recorded_launches.append((self, args))
        return original_launch(self, *args)
    setattr(backend, method, record_call)
    BoundKernel.launch = record_launch
    try:
        result = fn()
        hook = result[-1] if isinstance(result, tuple) and callable(result[-1]) else None
        if hook is not None:
            hook()
    finally:
        BoundKernel.launch = original_launch
        del backend.__dict__[method]
    torch.cuda.synchronize()
    full = _per_call_us(fn, n)
    torch.cuda.synchronize()
    args, kwargs = recorded_call[0]
    backend_us = _per_call_us(lambda: original_method(*args, **kwargs), n)
    torch.cuda.synchronize()

    def replay():
        for kernel, launch_args in recorded_launches:
            original_launch(kernel, *launch_args)
    launches = _per_call_us(replay, n)
    torch.cuda.synchronize()
    return full, backend_us, launches, recorded_launches


def _launch_paths(recorded_launches, rounds: int = 12, burst: int = 40):
    """The recorded launches of one call replayed with their arguments as given and with every
    tensor replaced by its address (Triton's launcher asks the driver about each tensor pointer),
    interleaved burst by burst (a shared host drifts). µs per call, least over bursts."""
    def as_ints(args):
        return tuple(a if a.__class__ is int else a.data_ptr() for a in args)
    launches = [(kernel, args[:3], tuple(args[3:]), as_ints(args[3:])) for kernel, args in recorded_launches]

    def replay(int_args):
        for kernel, grid_stream, args, ints in launches:
            kernel.launch(*grid_stream, *(ints if int_args else args))
    times = {"as given": [], "int pointers": []}
    for _ in range(rounds):
        for name, int_args in (("as given", False), ("int pointers", True)):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(burst):
                replay(int_args)
            times[name].append((time.perf_counter() - started) / burst * 1e6)
    torch.cuda.synchronize()
    tensors = [sum(a.__class__ is not int for a in args) for _, _, args, _ in launches]
    return {name: min(t) for name, t in times.items()}, tensors


def profile_rank(tokens: int):
    import epcomm
    from epcomm import checks
    from epcomm.backends.gpu import mailbox
    from epcomm.backends.gpu.launch import current_stream
    from epcomm.fp8 import per_token_cast_to_fp8
    rank, R = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    T, H, K, E, M = tokens, 7168, 8, 256, 128
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    topk = (torch.randn(T, E, device=dev, generator=g).abs() + 1).topk(K, dim=-1).indices
    w = torch.rand(T, K, device=dev, generator=g)
    buf = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 30)
    cfg = epcomm.Config(24, 8, 256)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg)
    x8 = per_token_cast_to_fp8(x)
    handle8 = buf.dispatch(x8, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg)[4]
    ll = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True,
                       num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E))
    xl, tl_, wl = x[:M].contiguous(), topk[:M].contiguous(), w[:M].contiguous()
    lrecv, _, lhandle, _, _ = ll.low_latency_dispatch(xl, tl_, M, E, use_fp8=True)
    y = torch.zeros(E // R, R * M, H, dtype=torch.bfloat16, device=dev)
    calls = {
        "get_dispatch_layout": (lambda: buf.get_dispatch_layout(topk, E), "dispatch_layout"),
        "dispatch cached bf16": (lambda: buf.dispatch(x, handle=handle, config=cfg), "dispatch"),
        "dispatch cached fp8": (lambda: buf.dispatch(x8, handle=handle8, config=cfg), "dispatch"),
        "combine": (lambda: buf.combine(recv, handle, config=cfg), "combine"),
        "ll dispatch": (lambda: ll.low_latency_dispatch(xl, tl_, M, E, use_fp8=True), "low_latency_dispatch"),
        "ll combine": (lambda: ll.low_latency_combine(y, tl_, wl, lhandle), "low_latency_combine"),
    }
    report = []
    if rank == 0:
        probe = mailbox._probe_kernel.bind(num_warps=1)
        scratch = torch.zeros(1, dtype=torch.int64, device=dev)
        host_word = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        from epcomm.backends.gpu.normal import one_node as normal
        layout_kernel = normal.LAYOUT.bind(num_warps=4, BLOCK_T=128, E_P2=256, K_P2=8, R_P2=2, N_P2=1, HAS_NODES=False,
                                           SUM_ROWS=16)
        per_rank = torch.empty(R, dtype=torch.int32, device=dev)
        layout_tensors = [topk, per_rank, per_rank, torch.empty(E, dtype=torch.int32, device=dev),
                          torch.empty(T, R, dtype=torch.bool, device=dev), torch.empty(64, 259, dtype=torch.int32, device=dev)]
        layout_state = buf._backend.state.data_ptr()
        block = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
        report.append("primitive costs (µs/call):")
        for name, fn in (
                ("torch.empty 1 MB uint8", lambda: torch.empty(1 << 20, dtype=torch.uint8, device=dev)),
                ("slice+view(dtype)+view(shape)", lambda: block[256:512].view(torch.int32).view(8, 8)),
                ("bound launch (2 args)", lambda: probe.launch(1, 1, current_stream(dev.index), host_word.data_ptr(), scratch)),
                ("raw stream handle", lambda: current_stream(dev.index)),
                ("layout launch, 5 tensor pointers", lambda: layout_kernel.launch(
                    1, 1, current_stream(dev.index), *layout_tensors, buf._backend.state, host_word.data_ptr(), 0, 0, E, R, E // R, R)),
                ("layout launch, 5 int pointers", lambda: layout_kernel.launch(
                    1, 1, current_stream(dev.index), *[t.data_ptr() for t in layout_tensors], layout_state, host_word.data_ptr(), 0, 0, E, R,
                    E // R, R)),
                ("torch.empty [8] int32, device obj", lambda: torch.empty(8, dtype=torch.int32, device=dev)),
                ("torch.empty [8] int32, device int", lambda: torch.empty(8, dtype=torch.int32, device=dev.index)),
                ("x.new_empty [8] int32", lambda: x.new_empty(8, dtype=torch.int32)),
                ("torch.empty [264] + split 2", lambda: torch.empty(264, dtype=torch.int32, device=dev).split([8, 256])),
                ("torch.empty [T, R] bool", lambda: torch.empty((T, R), dtype=torch.bool, device=dev)),
                ("check_tensor", lambda: checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(T, None), device=dev)),
                ("x.data_ptr()", lambda: x.data_ptr())):
            report.append(f"  {name:<34} {_per_call_us(fn):7.2f}")
        torch.cuda.synchronize()
    report.append("\nper call (µs): full = Buffer method; backend = the backend's method alone on the same arguments;"
                  "\nlaunches = its kernel launches replayed alone; front = full - backend; glue = backend - launches")
    report.append(f"  {'call':<22} {'full':>6} {'front':>6} {'backend':>8} {'glue':>6} {'launches':>9} {'n':>2}")
    paths = {}
    for name, (fn, method) in calls.items():
        try:
            full, backend, launches, recorded = _breakdown(fn, buf._backend if not name.startswith("ll") else
                                                           ll._backend, method)
            count = len(recorded)
            paths[name] = _launch_paths(recorded)
        except Exception as err:  # a replayed launch may upset the kernels' pairing: report, go on
            report.append(f"  {name:<22} failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        report.append(f"  {name:<22} {full:6.1f} {full - backend:6.1f} {backend:8.1f} {backend - launches:6.1f} "
                      f"{launches:9.1f} {count:2d}")
    report.append("\nthe same launches, arguments as given / tensors as int addresses, interleaved (µs per call):")
    for name, (times, tensors) in paths.items():
        report.append(f"  {name:<22} tensor arguments per launch {tensors}: " +
                      "  ".join(f"{path} {t:.1f}" for path, t in times.items()))
    buf.destroy()
    ll.destroy()
    return "\n".join(report)


if __name__ == "__main__":
    from epcomm.testing import run_distributed
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    print(run_distributed(profile_rank, torch.cuda.device_count(), tokens, backend="nccl", timeout_s=600)[0])
