"""GPU time of the expert-major re-layout: the torch functions (expert_major.py) against the
kernels the nvshmem backend uses (backends/gpu/expert_major_kernels.py), on one GPU, same data.

Run on a GPU machine: ``python3 scripts/profile_expert_major.py [plain_rows] [hidden]`` (default
8161 rows — what rank 0 receives at T=4096 on two ranks — H=7168, top-8 of 128 local experts).
Prints a table of medians (µs) and checks the two agree bit for bit.
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def _median_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(num_plain: int, hidden: int, num_topk: int = 8, num_local: int = 128) -> None:
    from epcomm import expert_major
    from epcomm.backends.gpu import expert_major_kernels as kernels
    from epcomm.fp8 import per_token_cast_to_fp8
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    # about half the entries local, as with two ranks of 128 experts each
    topk = torch.randint(-num_local, num_local, (num_plain, num_topk), device=dev, generator=g).clamp_min(-1)
    weights = torch.rand(num_plain, num_topk, device=dev, generator=g)
    sizes = torch.bincount(topk[topk >= 0], minlength=num_local).tolist()
    mapping = expert_major.plan(topk, weights, sizes)
    x = torch.randn(num_plain, hidden, device=dev, generator=g).to(torch.bfloat16)
    x8 = per_token_cast_to_fp8(x)
    y = torch.randn(mapping.num_rows, hidden, device=dev, generator=g).to(torch.bfloat16)
    assert torch.equal(kernels.expand(x, mapping), expert_major.expand(x, mapping))
    assert torch.equal(kernels.fold(y, mapping), expert_major.fold(y, mapping))
    rows = [
        ("plan (torch, no host sync)", lambda: expert_major.plan(topk, weights, sizes), None),
        ("expand bf16", lambda: expert_major.expand(x, mapping), lambda: kernels.expand(x, mapping)),
        ("expand fp8", lambda: expert_major.expand(x8, mapping), lambda: kernels.expand(x8, mapping)),
        ("fold", lambda: expert_major.fold(y, mapping), lambda: kernels.fold(y, mapping)),
    ]
    print(f"# expert-major re-layout, {torch.cuda.get_device_name(dev)}: {num_plain} plain rows, H={hidden}, "
          f"top-{num_topk}, {num_local} local experts -> {mapping.num_rows} rows; GPU µs, median of 20")
    print(f"{'step':<28} {'torch':>9} {'kernel':>9} {'torch/kernel':>13}")
    for name, torch_fn, kernel_fn in rows:
        torch_us = _median_us(torch_fn)
        if kernel_fn is None:
            print(f"{name:<28} {torch_us:9.1f} {'-':>9} {'-':>13}")
            continue
        kernel_us = _median_us(kernel_fn)
        print(f"{name:<28} {torch_us:9.1f} {kernel_us:9.1f} {torch_us / kernel_us:12.1f}x")
    print("checks: expand and fold equal the torch functions bit for bit: OK")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8161, int(sys.argv[2]) if len(sys.argv) > 2 else 7168)
