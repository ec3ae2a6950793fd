"""Where the host time of each call goes (rank 0): primitive costs, then each call split into its
front end (Buffer), the backend's glue and its kernel launches; the full dispatch (top-k, BF16)
split by timestamps into front end, glue, launches and the host's wait for the count exchange, and
its host time over a cached dispatch's of the same shape; then the full, num_worst_tokens and cached
dispatch interleaved, uninstrumented.

Run on a GPU machine: ``python3 scripts/profile_host.py [tokens]`` (``--full-only``: only the full
dispatch's part, seconds). ``--cpu-front``: no GPU, the Buffer front end alone on the CPU (a stub
backend that returns ready results), for changes to buffer.py / checks.py. Host cost is the risk
of a Python design (docs/PERFORMANCE.md); this shows which Python lines a call spends it on.
"""
import argparse
import os
import statistics
import sys
import time
import timeit

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


def _function_costs(fn, calls: int, top: int = 14):
    """Where one call's host time goes by function: ``fn`` run ``calls`` times under cProfile, the
    ``top`` functions by own time (µs per call; the profiler adds ~0.5 µs per Python call, so read
    the order and the C calls' costs, not the sum), each as ``file:line(function)``."""
    import cProfile
    import pstats
    fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(((own, n, where) for where, (_, n, own, _, _) in stats.items()), reverse=True)[:top]
    return [f"    {own / calls * 1e6:6.2f} µs  {n / calls:5.1f}x  {os.path.basename(where[0])}:{where[1]}({where[2]})"
            for own, n, where in rows]


SPLIT = ("total", "front", "pre", "launch", "glue<", "wait", "glue>", "handle")


def _full_dispatch_split(buf, call, calls: int, synced: bool, burst: int = 40):
    """One full dispatch (``call``) split by timestamps (perf_counter_ns) into ``SPLIT``, median µs per
    call over ``calls`` calls: total = Buffer.dispatch; front = what runs before and after the
    backend's ``normal.dispatch`` (Buffer's checks, the backend's check_dispatch, the handle laid
    out); pre = the backend's code before its first launch (the notify's outputs); launch = every
    kernel launch (their number: the launches column); glue< = the rest before the wait for the
    count exchange (the stage's arguments); wait = inside HostMailbox.wait_notify (the host polling
    pinned memory for the notify's counts); glue> = the rest after it (the outputs, the pull's
    arguments); handle = PullState, DispatchHandle and DispatchResult built. Wrappers patched at
    this level, not in the library; each costs ~0.2 µs, which lands in its neighbours' columns.
    ``synced``: the GPU drained before each call (not timed); else bursts of ``burst`` back to back."""
    from epcomm.backends.gpu.launch import BoundKernel
    clock = time.perf_counter_ns
    backend = buf._backend
    normal, mailbox = backend.normal, backend.mailbox
    module = sys.modules[type(normal).__module__]
    events = []  # (kind, start ns, end ns) of the call being timed

    def timed(kind, fn):
        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                events.append((kind, start, clock()))
        return wrapper
    originals = {"launch": BoundKernel.launch, "launch_resident": BoundKernel.launch_resident}
    built = [name for name in ("PullState", "DispatchHandle", "DispatchResult") if hasattr(module, name)]
    saved = {name: getattr(module, name) for name in built}
    BoundKernel.launch = timed("launch", originals["launch"])
    BoundKernel.launch_resident = timed("launch", originals["launch_resident"])
    normal.dispatch = timed("backend", normal.dispatch)  # (an instance attribute: the class keeps its own)
    mailbox.wait_notify = timed("wait", mailbox.wait_notify)
    for name in built:
        setattr(module, name, timed("handle", saved[name]))
    rows, launches = [], 0
    try:
        for i in range(calls + burst):
            if synced or i % burst == 0:
                torch.cuda.synchronize()
            events.clear()
            start = clock()
            call()
            end = clock()
            if i < burst:  # warm-up
                continue
            (_, b_start, b_end), = [e for e in events if e[0] == "backend"]
            spans = {kind: [(s, e) for k, s, e in events if k == kind] for kind in ("launch", "wait", "handle")}
            launch = sum(e - s for s, e in spans["launch"])
            wait = sum(e - s for s, e in spans["wait"])
            wait_start = spans["wait"][0][0] if spans["wait"] else b_end
            pre = (spans["launch"][0][0] if spans["launch"] else b_end) - b_start
            before = wait_start - b_start - pre - sum(e - s for s, e in spans["launch"] if s < wait_start)
            handle = sum(e - s for s, e in spans["handle"])
            after = (b_end - b_start) - pre - launch - wait - before - handle
            rows.append((end - start, (b_start - start) + (end - b_end), pre, launch, before, wait, after, handle))
            launches = len(spans["launch"])
    finally:
        BoundKernel.launch, BoundKernel.launch_resident = originals["launch"], originals["launch_resident"]
        del normal.dispatch, mailbox.wait_notify
        for name in built:
            setattr(module, name, saved[name])
    torch.cuda.synchronize()
    return [statistics.median(column) / 1e3 for column in zip(*rows)], launches


def _plain_us(fns: dict, rounds: int = 12, burst: int = 40, synced_calls: int = 200):
    """µs per call of each of ``fns``, uninstrumented: back to back (least over bursts of ``burst``,
    the calls' bursts interleaved: a shared host drifts) and after a sync (median of single calls)."""
    b2b = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(burst):
                fn()
            b2b[name].append((time.perf_counter() - started) / burst * 1e6)
    synced = {name: [] for name in fns}
    for _ in range(synced_calls):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            synced[name].append((time.perf_counter() - started) * 1e6)
    torch.cuda.synchronize()
    return {name: (min(b2b[name]), statistics.median(synced[name])) for name in fns}


def _full_dispatch_report(buf, full, cached, calls: int):
    """The full dispatch's split (both regimes) and its host time over a cached dispatch's."""
    full(), cached()
    plain = _plain_us({"full": full, "cached": cached})
    report = [f"\nfull dispatch (top-k, BF16), µs per call, median; {type(buf._backend.normal).__name__}; "
              f"columns: _full_dispatch_split's docstring",
              f"  {'regime':<13}" + "".join(f"{name:>8}" for name in SPLIT) + "  launches  plain"]
    for regime, synced in (("back to back", False), ("after a sync", True)):
        split, launches = _full_dispatch_split(buf, full, calls, synced)
        plain_us = plain["full"][1 if synced else 0]
        report.append(f"  {regime:<13}" + "".join(f"{v:8.1f}" for v in split) + f"  {launches:8d}  {plain_us:5.1f}")
    (full_b2b, full_synced), (cached_b2b, cached_synced) = plain["full"], plain["cached"]
    report.append(f"  uninstrumented: full {full_b2b:.1f} / {full_synced:.1f}, cached {cached_b2b:.1f} / "
                  f"{cached_synced:.1f} (back to back, least of bursts / after a sync, median); "
                  f"full - cached {full_b2b - cached_b2b:.1f} / {full_synced - cached_synced:.1f} "
                  f"(DeepEP V1, issue: ~40-42)")
    return report


MAX_VARIANTS = 4  # --variants: Buffers on one group beside the defaults' (the call board has 7 slots)


def _variants_report(make_buffer, x, layout, handle_of, cfg, variants) -> list:
    """Host µs per call of the full, the num_worst_tokens and the cached dispatch with each of ``variants`` (one-node
    normal-mode variants, bench.NORMAL_VARIANTS, ``+`` joining several) beside the defaults: one
    Buffer each on the same group, their calls interleaved (``_plain_us``), so a shared host's drift
    falls on all alike."""
    from epcomm.tools.bench import use_normal_variants
    per_rank, per_expert, in_rank, topk, w = layout
    fns, buffers = {}, []
    for variant in ["default"] + list(variants):
        buf = make_buffer()
        buffers.append(buf)
        if variant != "default":
            if not hasattr(buf._backend.normal, "every_peer"):  # (bench.py: one node's variants only)
                raise SystemExit(f"--variants: the {buf.backend_name} backend has no one-node variants")
            use_normal_variants(buf._backend.normal, [variant])

        def full(buf=buf):
            return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg)
        def worst(buf=buf):
            return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg,
                                num_worst_tokens=dist.get_world_size() * x.shape[0])
        handle = handle_of(full())
        fns[variant, "full"] = full
        fns[variant, "worst"] = worst
        fns[variant, "cached"] = lambda buf=buf, handle=handle: buf.dispatch(x, handle=handle, config=cfg)
    plain = _plain_us(fns)
    report = ["\nfull, num_worst_tokens and cached dispatch per variant, host µs per call, one Buffer each, "
              "interleaved (back to back, least of bursts / after a sync, median):",
              f"  {'variant':<34} {'full':>15} {'num_worst':>15} {'cached':>15} {'full - cached':>15}"]
    for variant in ["default"] + list(variants):
        (full_b2b, full_synced), (cached_b2b, cached_synced) = plain[variant, "full"], plain[variant, "cached"]
        worst_b2b, worst_synced = plain[variant, "worst"]
        report.append(f"  {variant:<34} {full_b2b:6.1f} / {full_synced:6.1f} {worst_b2b:6.1f} / {worst_synced:6.1f} "
                      f"{cached_b2b:6.1f} / {cached_synced:6.1f} "
                      f"{full_b2b - cached_b2b:6.1f} / {full_synced - cached_synced:6.1f}")
    for buf in buffers:
        buf.destroy()
    return report


def profile_rank(tokens: int, full_only: bool = False, split_calls: int = 400, functions: int = 0,
                 variants: tuple = ()):
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

    def full():
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=topk, topk_weights=w, config=cfg)
    recv, _, _, _, handle, _ = full()
    full_dispatch = full  # (the table below reuses the name ``full`` for a time)
    # (before the low-latency Buffer exists: one Buffer on the group, as in `epcomm bench normal`)
    full_report = _full_dispatch_report(buf, full, lambda: buf.dispatch(x, handle=handle, config=cfg), split_calls)
    if full_only:
        buf.destroy()
        if variants:
            full_report += _variants_report(lambda: epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 30), x,
                                            (per_rank, per_expert, in_rank, topk, w), lambda result: result[4], cfg,
                                            variants)
        return "\n".join(full_report)
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
        layout_per_rank = torch.empty(R, dtype=torch.int32, device=dev)  # (not per_rank: full() reads that)
        layout_tensors = [topk, layout_per_rank, layout_per_rank, torch.empty(E, dtype=torch.int32, device=dev),
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
    report += full_report

    def worst():  # no host wait (sizes known): the eager form of what an engine captures for a small batch
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=topk, topk_weights=w, num_worst_tokens=R * T, config=cfg)
    compared = {"full": full_dispatch, "num_worst": worst, "cached": calls["dispatch cached bf16"][0]}
    try:
        worst()  # (refused on every rank alike where the batch needs rounds: reported, the rest goes on)
    except Exception as err:
        report.append(f"\nnum_worst_tokens dispatch refused: {type(err).__name__}: {str(err)[:200]}")
        del compared["num_worst"]
    plain = _plain_us(compared)
    report.append("\nuninstrumented, interleaved (back to back, least of bursts / after a sync, median), µs: " +
                  ", ".join(f"{name} {b2b:.1f} / {synced:.1f}" for name, (b2b, synced) in plain.items()))
    if functions:
        report.append(f"\nown time by function, cProfile over {functions} calls (µs per call, calls per call):")
        profiled = dict(calls, **{"dispatch full bf16": (full_dispatch, "dispatch")})
        if "num_worst" in compared:
            profiled["dispatch num_worst bf16"] = (worst, "dispatch")
        for name, (fn, _) in profiled.items():
            report.append(f"  {name}")
            try:
                report += _function_costs(fn, functions)
            except Exception as err:  # reported, the others go on
                report.append(f"    failed: {type(err).__name__}: {str(err)[:200]}")
    report.append("\nthe same launches, arguments as given / tensors as int addresses, interleaved (µs per call):")
    for name, (times, tensors) in paths.items():
        report.append(f"  {name:<22} tensor arguments per launch {tensors}: " +
                      "  ".join(f"{path} {t:.1f}" for path, t in times.items()))
    buf.destroy()
    ll.destroy()
    return "\n".join(report)


def _cpu_front(tokens: int, rounds: int = 30, number: int = 4000) -> str:
    """The Buffer front end alone on the CPU: a one-rank gloo group, a stub backend that returns
    ready results (its own cost shown apart), value checks off as on the GPU fast path. µs per call,
    the least of ``rounds`` timeit runs of ``number`` calls. The group is gone on return."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _cpu_front_rows(tokens, rounds, number)
    finally:
        dist.destroy_process_group()


def _cpu_front_rows(tokens: int, rounds: int, number: int) -> str:
    """:func:`_cpu_front`'s table, in the one-rank group it made."""
    import epcomm
    from epcomm.backends.base import Backend, DispatchArgs, DispatchResult
    from epcomm.fp8 import per_token_cast_to_fp8
    from epcomm.handle import DispatchHandle
    T, H, K, E = tokens, 7168, 8, 256
    buf = epcomm.Buffer(dist.group.WORLD, device="cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk = (torch.randn(T, E, generator=g).abs() + 1).topk(K, dim=-1).indices
    w = torch.rand(T, K, generator=g)
    x8 = per_token_cast_to_fp8(x)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    prefix, src_idx = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)
    recv_topk, recv_w = torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, K)

    class Stub(Backend):  # the base's defaults for what Buffer asks; dispatch builds a handle and a result
        native_expert_major = True

        def dispatch(self, args):
            full = args.handle is None
            handle = DispatchHandle(prefix, src_idx, in_rank, T, T, None, None)
            return DispatchResult(args.x, recv_topk if full else None, recv_w if full else None, [T] if full else None,
                                  handle)

        def dispatch_layout(self, topk_idx, num_experts, ranks_per_node):
            return per_rank, None, per_expert, in_rank

        def combine(self, *args, **kwargs):
            raise NotImplementedError("the CPU front-end profile times dispatch only")
        low_latency_dispatch = low_latency_combine = combine
    stub = buf._backend = Stub(buf.group, buf.device)
    buf._check_values = False
    cfg = epcomm.Config(24, 8, 256)
    handle = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          topk_idx=topk, topk_weights=w, config=cfg)[4]
    args = DispatchArgs(x=x, handle=None, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, expert_alignment=1,
                        num_worst_tokens=0, config=cfg)
    rows = {
        "dispatch, full (top-k)": lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                       num_tokens_per_expert=per_expert, topk_idx=topk,
                                                       topk_weights=w, config=cfg),
        "dispatch, full (top-k), FP8": lambda: buf.dispatch(x8, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                            num_tokens_per_expert=per_expert, topk_idx=topk,
                                                            topk_weights=w, config=cfg),
        "dispatch, cached": lambda: buf.dispatch(x, handle=handle, config=cfg),
        "dispatch, cached, FP8": lambda: buf.dispatch(x8, handle=handle, config=cfg),
        "get_dispatch_layout": lambda: buf.get_dispatch_layout(topk, E),
        "  stub dispatch (in the rows above)": lambda: stub.dispatch(args),
        "  DispatchArgs(...)": lambda: DispatchArgs(x=x, handle=None, num_tokens_per_rank=per_rank,
                                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                   topk_idx=topk, topk_weights=w, expert_alignment=1,
                                                   num_worst_tokens=0, config=cfg),
        "  check_tensor": lambda: epcomm.checks.check_tensor("x", x, dtype=torch.bfloat16, shape=(T, None),
                                                            device=buf.device),
    }
    report = [f"Buffer front end on the CPU (stub backend, T={T}), µs per call:"]
    for name, fn in rows.items():
        fn()
        report.append(f"  {name:<36} {min(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6:6.2f}")
    return "\n".join(report)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokens", nargs="?", type=int, default=512, help="tokens per rank (default 512)")
    parser.add_argument("--full-only", action="store_true", help="only the full dispatch's split and full - cached")
    parser.add_argument("--split-calls", type=int, default=400, help="timed calls per regime of the full split")
    parser.add_argument("--cpu-front", action="store_true", help="no GPU: the Buffer front end with a stub backend")
    parser.add_argument("--functions", type=int, default=0, metavar="CALLS",
                        help="also each call's host time by function: cProfile over CALLS calls (not with --full-only)")
    parser.add_argument("--variants", default="", metavar="V1,V2",
                        help="with --full-only: the full and cached dispatch's host time with each one-node variant "
                             "(epcomm bench normal --variants names) beside the defaults, interleaved")
    options = parser.parse_args(argv)
    variants = ()
    if options.variants:
        if not options.full_only:
            parser.error("--variants goes with --full-only")
        from epcomm.tools.bench import normal_variants
        try:
            variants = tuple(dict.fromkeys(normal_variants(options.variants)))  # (each once)
        except ValueError as err:
            parser.error(str(err))
        if len(variants) > MAX_VARIANTS:
            parser.error(f"--variants takes at most {MAX_VARIANTS} (a Buffer of 1 GiB each, beside the defaults')")
    if options.functions and options.full_only:
        parser.error("--functions profiles every call: it does not go with --full-only")
    if options.cpu_front:
        print(_cpu_front(options.tokens))
        return
    from epcomm.testing import run_distributed
    print(run_distributed(profile_rank, torch.cuda.device_count(), options.tokens, options.full_only,
                          options.split_calls, options.functions, variants, backend="nccl", timeout_s=600)[0])


if __name__ == "__main__":
    main()
