"""Raw row-mover rates between GPUs: Triton pull vs push (copy_rows_kernel) vs copy engine.

Each rank moves N rows of H bf16 from/to the next rank's symmetric memory, rows permuted, and
reports GB/s of off-rank bytes (median of CUDA-event timings). Run on a GPU machine:
``python3 scripts/copy_micro.py [rows] [hidden]``.
"""
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def micro_rank(rows: int, hidden: int):
    import torch.distributed._symmetric_memory as symm_mem
    import triton
    from epcomm.backends.nvlink import backend as nv
    from epcomm.backends.nvlink import kernels
    R, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    row_bytes = hidden * 2
    buf = symm_mem.empty(rows * row_bytes, dtype=torch.uint8, device=dev)
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    bases = torch.tensor(list(hdl.buffer_ptrs), dtype=torch.int64, device=dev)
    local = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
    peer = torch.full((rows,), (rank + 1) % R, dtype=torch.int32, device=dev)
    perm = torch.randperm(rows, device=dev).to(torch.int32)
    n = torch.tensor([rows], dtype=torch.int32, device=dev)
    dummy = torch.zeros(1, dtype=torch.int32, device=dev)
    words = row_bytes // 8

    def run(sms, tile, warps, push):
        block_c = min(triton.next_power_of_2(words), tile)
        block_r = max(tile // block_c, 1)
        if push:
            args = (local, dummy, dummy, words, bases, peer, perm, words)
        else:
            args = (bases, peer, perm, words, local, dummy, dummy, words)
        kernels.copy_rows_kernel[(sms,)](*args, n, rows, words, 0, 2 ** 62, WORD=8, WORD_TY=nv._WORD_TYPES[8],
                                         SRC_INDEXED=not push, DST_INDEXED=push, BLOCK_R=block_r, BLOCK_C=block_c,
                                         num_warps=warps)

    def ce():
        hdl.get_buffer((rank + 1) % R, (rows * row_bytes,), torch.uint8, 0).copy_(local.view(torch.uint8).view(-1))

    def timed(fn, reps=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            dist.barrier()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        return rows * row_bytes / statistics.median(times) / 1e9

    out = {"copy engine": timed(ce)}
    for push in (False, True):
        for sms in (24, 32, 64):
            for tile, warps in ((8192, 16), (16384, 16), (16384, 32), (32768, 32)):
                out[f"{'push' if push else 'pull'} sms={sms} tile={tile} warps={warps}"] = timed(
                    lambda: run(sms, tile, warps, push))
    return out


if __name__ == "__main__":
    from epcomm.testing import run_distributed
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    hidden = int(sys.argv[2]) if len(sys.argv) > 2 else 7168
    result = run_distributed(micro_rank, torch.cuda.device_count(), rows, hidden, backend="nccl")[0]
    for k, v in result.items():
        print(f"{k:<40} {v:8.1f} GB/s")
