"""The pulls' items on the kernel clock: one traced full dispatch (its pull in turn) and one traced
cached dispatch (the one launch), every rank, T=--tokens at DeepEP's routing with the defaults, and
per call and rank the items, span, median item time from this rank's rows and from its peers', the
programs' busy share, and how far apart they started and ended (tests/schedule_trace_cases.py,
item_table). It says where the full dispatch's pull in turn loses to the one launch across GPUs.

Run on a machine with 2+ GPUs: ``python3 scripts/trace_items.py [--tokens 4096] [--ranks N]
[--variants NAME,...]`` (each variant's full dispatch traced too, after the defaults').
"""
import argparse
import os
import sys

import torch

FOLDERS = [os.path.abspath(os.path.join(os.path.dirname(__file__), "..", folder)) for folder in ("src", "tests")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    parser.add_argument("--ranks", type=int, default=0, help="ranks, one per GPU (default: every GPU)")
    parser.add_argument("--variants", default="",
                        help="comma list of `epcomm bench normal --variants` names: a further traced full dispatch "
                             "with each (default none)")
    args = parser.parse_args()
    if args.tokens < 1 or args.ranks < 0:
        parser.error("--tokens must be positive and --ranks 0 or more")
    world = args.ranks or torch.cuda.device_count()
    if world < 2 or torch.cuda.device_count() < world:
        print(f"trace_items.py needs {max(world, 2)} CUDA GPUs", file=sys.stderr)
        return 2
    sys.path[:0] = FOLDERS
    # (the ranks' processes import the traced function's module too)
    os.environ["PYTHONPATH"] = os.pathsep.join(FOLDERS + [p for p in [os.environ.get("PYTHONPATH")] if p])
    from epcomm.testing import run_distributed
    import schedule_trace_cases
    from epcomm.tools.bench import normal_variants
    try:
        variants = normal_variants(args.variants)
    except ValueError as exc:
        parser.error(str(exc))
    per_rank = run_distributed(schedule_trace_cases.trace_dispatch_items, world, args.tokens, variants=variants,
                               backend="nccl", timeout_s=180)  # (within speed_run.sh's 200 s)
    print(f"# items of the pulls, {world} ranks, T={args.tokens} (µs on each rank's own GPU clock)")
    print("\n".join(schedule_trace_cases.item_table(per_rank)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
