"""Command line: ``epcomm demo | info | check | bench``."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys


def _info() -> int:
    import torch

    import epcomm
    print(f"epcomm   {epcomm.__version__}")
    print(f"torch    {torch.__version__}")
    try:
        import triton
        from ..backends.nvlink.launch import launch_mode
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
    import os
    override = os.environ.get("EPCOMM_BACKEND")
    print(f"backend  {override + ' (EPCOMM_BACKEND)' if override else backend}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="epcomm", description="Expert-parallel dispatch/combine for MoE.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="EP MoE layer forward in normal and low-latency mode, checked against one process")
    demo.add_argument("--ranks", type=int, default=0, help="number of ranks (default: all GPUs, else 4 CPU ranks)")
    demo.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    demo.add_argument("--hidden", type=int, default=512)
    demo.add_argument("--experts-per-rank", type=int, default=4)
    demo.add_argument("--topk", type=int, default=4)
    demo.add_argument("--iters", type=int, default=5)
    sub.add_parser("info", help="versions, GPUs and links, the backend that would run")
    check = sub.add_parser("check", help="randomized correctness checks of the backend that would run here")
    check.add_argument("--ranks", type=int, default=0, help="number of ranks (default: all GPUs, else 4 CPU ranks)")
    check.add_argument("--cases", type=int, default=24, help="randomized cases per mode")
    bench = sub.add_parser("bench", help="benchmark against the NCCL baseline (GPU)")
    bench.add_argument("mode", choices=["normal", "low-latency"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
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
        from .bench import main as bench_main
        return bench_main([args.mode] + args.rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
