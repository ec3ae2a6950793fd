"""Each one-node normal-mode kernel alone at HBM speed: one rank (every row is local, so no link
sets the pace), T tokens of H, ``Config(num_sms)`` programs; each kernel's mean device time under
torch.profiler over ``--calls`` calls of each phase (full dispatch, cached dispatch, combine).

    PYTHONPATH=src python3 scripts/kernels_alone.py [--tokens 4096] [--hidden 7168] [--sms 24] [--calls 20] [--label L]
                                                    [--variants serial-combine,tile-reduce,...] [--lanes 8]
                                                    [--phases full,cached,combine,low-latency,full-no-topk,worst]
                                                    [--ll-tokens 128]

A regression check of the kernels' per-program rate (issue "every link busy": pull 79, push 78,
stage 57, reduce 42 µs on one H200 before the schedule change). For a before/after table, run it
twice in one device call with PYTHONPATH on the two trees. Prints ``label phase kernel µs`` lines,
and per phase the µs per call of ``--calls`` calls issued back to back between two CUDA events
(the kernels, the gaps between them and, in a full dispatch, the host's wait for the counts).

``--lanes R`` compiles the kernels for R ranks' peer lanes (R_P2; the lanes past this one rank are
masked, as those past a group of 6 are at R_P2 = 8) while moving one rank's rows: the tiles,
layouts and shared-memory rounds of an R-rank node (with ``--tile-reduce`` the combine's reduce
sums [R, BLOCK_C] tiles, BLOCK_C = 16384 / R; by default a token's R rows one at a time, 8192
columns a step), timed on one GPU. The rows are still one rank's, so it times what the lanes
cost, not the links.

The ``full-no-topk`` phase (not among the defaults) times a full dispatch without top-k: its stage
writes the lists without the per-expert count check (the top-k rows' histogram) and stages no
top-k rows, so beside ``full`` it shows what that check costs the stage.

The ``worst`` phase (not among the defaults) times a full dispatch with ``num_worst_tokens`` = T:
one launch with its count exchange (ep_dispatch with NOTIFY) by default, two with ``--variants
notify-apart`` (the count exchange, then ep_dispatch): run both for the GPU time of the one launch.

The ``low-latency`` phase (not among the defaults) times a low-latency round trip's kernels at
``--ll-tokens`` per rank, top-8 of 256, FP8 dispatch and BF16 combine, on a low-latency Buffer of
its own.
"""
import argparse
import socket
import sys

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--sms", type=int, default=24)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--variants", default="",
                        help="one-node variants, as epcomm bench normal --variants names them (a comma list, "
                             "combined here: e.g. serial-combine,tile-reduce)")
    parser.add_argument("--phases", default="full,cached,combine",
                        help="the phases timed, of full, cached, combine, low-latency, full-no-topk and worst "
                             "(a comma list)")
    parser.add_argument("--ll-tokens", type=int, default=128, help="tokens per rank of the low-latency phase")
    parser.add_argument("--lanes", type=int, default=1,
                        help="peer lanes the kernels are compiled for (a power of two: 8 = one node's tiles)")
    args = parser.parse_args()
    timed = args.phases.split(",")
    if not set(timed) <= {"full", "cached", "combine", "low-latency", "full-no-topk", "worst"}:
        parser.error(f"--phases takes full, cached, combine, low-latency, full-no-topk and worst (got {args.phases})")
    import epcomm
    from epcomm.tools.bench import normal_variants, use_normal_variants
    try:
        variants = normal_variants(args.variants)
    except ValueError as exc:
        parser.error(str(exc))
    from torch.profiler import ProfilerActivity, profile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dev = torch.device("cuda", 0)
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=2 << 30)
    use_normal_variants(buffer._backend.normal, variants)
    if args.lanes & (args.lanes - 1) or args.lanes < 1:
        parser.error(f"--lanes must be a power of two (got {args.lanes})")
    buffer._backend.normal.R_P2 = args.lanes  # (before the first call: the plans are made then)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=dev, generator=g).to(torch.bfloat16)
    topk = (torch.randn(args.tokens, 256, device=dev, generator=g).abs() + 1).topk(8, dim=-1).indices
    weights = torch.rand(args.tokens, 8, device=dev, generator=g)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 256)
    config = epcomm.Config(args.sms, 8, 256)

    def full():
        return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights, config=config)

    recv = full()
    assert torch.equal(recv[0], x), "one rank: the received rows are the tokens themselves"
    phases = {"full dispatch": full, "cached dispatch": lambda: buffer.dispatch(x, handle=recv[4], config=config),
              "combine": lambda: buffer.combine(recv[0], recv[4], config=config)}
    assert torch.equal(phases["cached dispatch"]()[0], x), "one rank: a cached dispatch receives the tokens too"
    combined = phases["combine"]()[0]
    assert torch.equal(combined, x), "one rank: each token's combine is its one row"
    if "full-no-topk" in timed:
        phases["full-no-topk dispatch"] = lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank,
                                                                  is_token_in_rank=in_rank,
                                                                  num_tokens_per_expert=per_expert, config=config)
    if "worst" in timed:  # (num_worst_tokens = T: one rank receives its T tokens, no padding)
        phases["worst dispatch"] = lambda: buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                           num_tokens_per_expert=per_expert, topk_idx=topk,
                                                           topk_weights=weights, config=config,
                                                           num_worst_tokens=args.tokens)
        assert torch.equal(phases["worst dispatch"]()[0], x), "one rank: num_worst_tokens = T receives the tokens"
    if "low-latency" in timed:
        phases["low-latency round trip"] = _low_latency_round_trip(args, dev, g)
    for phase, call in phases.items():
        if phase.split()[0] not in timed:
            continue
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.calls):
            call()
        end.record()
        torch.cuda.synchronize()
        print(f"{args.label} | {phase} | per call, back to back | {start.elapsed_time(end) * 1e3 / args.calls:.1f} us",
              flush=True)
        for event in prof.key_averages():
            device_us = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0))
            if event.key.startswith("ep_") and event.count:
                print(f"{args.label} | {phase} | {event.key} | {device_us / event.count:.1f} us | "
                      f"{event.count} launches", flush=True)
    buffer.destroy()
    dist.destroy_process_group()
    return 0


def _low_latency_round_trip(args, dev, g):
    """A low-latency dispatch (FP8) and combine of ``--ll-tokens`` tokens on a Buffer of its own,
    checked once (one rank: each token's combine is the sum of its K weighted rows, all its own)."""
    import epcomm
    from epcomm.fp8 import per_token_cast_back, per_token_cast_to_fp8
    T, E, K = args.ll_tokens, 256, 8
    ll = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True,
                       num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(T, args.hidden, 1, E))
    x = torch.randn(T, args.hidden, device=dev, generator=g).to(torch.bfloat16)
    topk = (torch.randn(T, E, device=dev, generator=g).abs() + 1).topk(K, dim=-1).indices
    weights = torch.rand(T, K, device=dev, generator=g)

    def round_trip():
        recv, _, handle, _, _ = ll.low_latency_dispatch(x, topk, T, E, use_fp8=True)
        return ll.low_latency_combine(per_token_cast_back(recv[0], recv[1]), topk, weights, handle)[0]

    want = per_token_cast_back(*per_token_cast_to_fp8(x)).float() * weights.sum(1, keepdim=True)
    got = round_trip().float()
    assert float((got - want).norm() / want.norm()) < 1e-2, "one rank: a token's combine is its K weighted rows"
    return round_trip


if __name__ == "__main__":
    sys.exit(main())
