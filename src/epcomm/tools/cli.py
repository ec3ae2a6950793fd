"""Command line: ``epcomm demo | info | check | bench | model | model-one-node``, ``epcomm --version``.

Every option has help text and shows its default (``epcomm <command> --help``), each command lists
only its own options; invalid values end in a one-line usage error, not a traceback.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from .args import hidden_size, non_negative_int, positive_int


def _info() -> int:
    import torch

    import epcomm
    print(f"epcomm   {epcomm.__version__}")
    print(f"torch    {torch.__version__}")
    try:
        import triton
        from ..backends.gpu.launch import launch_mode
        print(f"triton   {triton.__version__} (kernel launches: {launch_mode()})")
    except ImportError:
        print("triton   not installed (the nvlink backend needs it)")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        print(f"GPUs     {count}")
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            print(f"  cuda:{i} {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
        try:
            import triton  # noqa: F401
            backend = "nvlink"
        except ImportError:
            backend = "torch_dist (NCCL)"
        if shutil.which("nvidia-smi"):
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
            if topo.returncode == 0:
                print("links (nvidia-smi topo -m):")
                print(topo.stdout.rstrip())
    else:
        print("GPUs     none")
        backend = "torch_dist (gloo, CPU)"
    override = os.environ.get("EPCOMM_BACKEND")
    if override:
        from ..backends import BACKENDS
        if override not in BACKENDS:
            print(f"error: EPCOMM_BACKEND={override!r} is not one of {BACKENDS}", file=sys.stderr)
            return 2
        if override == "nvlink" and not torch.cuda.is_available():
            print("error: EPCOMM_BACKEND=nvlink, but this machine has no CUDA GPU: Buffer construction would fail",
                  file=sys.stderr)
            return 2
        backend = f"{override} (EPCOMM_BACKEND)"
    print(f"backend  {backend}")
    return 0


def main(argv=None) -> int:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    from .. import __version__
    parser = argparse.ArgumentParser(prog="epcomm", description="Expert-parallel dispatch/combine for MoE.",
                                     formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"epcomm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", formatter_class=formatter,
                          help="EP MoE layer forward in normal and low-latency mode, checked against one process")
    demo.add_argument("--ranks", type=non_negative_int, default=0, help="number of ranks (0: all GPUs, else 4 CPU ranks)")
    demo.add_argument("--tokens", type=positive_int, default=64, help="tokens per rank")
    demo.add_argument("--hidden", type=hidden_size, default=512, help="hidden size H (a multiple of 128)")
    demo.add_argument("--experts-per-rank", type=positive_int, default=4, help="experts each rank hosts")
    demo.add_argument("--topk", type=positive_int, default=4, help="experts per token (<= total experts)")
    demo.add_argument("--iters", type=positive_int, default=5, help="timed forward passes per mode")
    sub.add_parser("info", formatter_class=formatter, help="versions, GPUs and links, the backend that would run")
    check = sub.add_parser("check", formatter_class=formatter,
                           help="randomized correctness checks of the backend that would run here")
    check.add_argument("--ranks", type=non_negative_int, default=0, help="number of ranks (0: all GPUs, else 4 CPU ranks)")
    check.add_argument("--cases", type=positive_int, default=24, help="randomized cases per mode")
    bench = sub.add_parser("bench", formatter_class=formatter,
                           help="host/gpu/synced µs per call beside the NCCL baseline and optionally DeepEP "
                                "(needs 2 or more CUDA GPUs)",
                           description="Benchmark one mode on this machine's GPUs (2 or more CUDA GPUs; "
                                       "with --ranks-per-node, virtual nodes on the nvshmem backend). normal: "
                                       "get_dispatch_layout, dispatch (full, cached, FP8), combine, at --tokens "
                                       "and --extra-tokens per --sms setting. low-latency: dispatch + combine "
                                       "round trips at --tokens (default 128), eager and in a CUDA graph.")
    from .bench import add_arguments
    add_arguments(bench)
    model = sub.add_parser("model", formatter_class=formatter,
                           help="multi-node normal-mode time from the two-level plan's bytes and per-leg rates (CPU)")
    from . import internode_model
    internode_model.add_arguments(model)
    one_node_model = sub.add_parser("model-one-node", formatter_class=formatter,
                                    help="one-node normal-mode time from bytes, link and per-program rates, for "
                                         "both schedules of the pull and push (CPU)")
    from . import one_node_model as one_node
    one_node.add_arguments(one_node_model)
    args = parser.parse_args(argv)

    if args.command == "info":
        return _info()
    if args.command == "demo":
        from .demo import DemoSettings, run_demo
        settings = DemoSettings(tokens=args.tokens, hidden=args.hidden, experts_per_rank=args.experts_per_rank,
                                topk=args.topk, iters=args.iters)
        return run_demo(args.ranks, settings)
    if args.command == "check":
        from .check import run_check
        return run_check(args.ranks, args.cases)
    if args.command == "bench":
        from .bench import run
        return run(args)
    if args.command == "model":
        return internode_model.run(args)
    if args.command == "model-one-node":
        return one_node.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
