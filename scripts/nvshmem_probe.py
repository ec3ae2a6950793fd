"""Probe NVSHMEM from Triton through epcomm's launch layer (the first GPU step of the multi-node backend).

Run on a GPU machine: ``python3 scripts/nvshmem_probe.py`` (one process per GPU, or ``--ranks N``
processes over the GPUs). Prints, per phase, what worked: PyTorch's NVSHMEM symmetric memory
(``set_backend("NVSHMEM")``, ``empty``, ``rendezvous``, peer pointers), a put with signal from a
kernel compiled by ``KernelSpec(library=NVSHMEM)``, a bounded acquire-poll of the signal, the data,
and the rate of a 64 MiB put; then the low-latency kernels' primitives (device.send_bytes: a
non-blocking block put, complete_sends: quiet, set_words: a signal SET with a masked lane sent to
the spare word; a second SET of the same value must leave it: SIGNAL_SET is the library's code).
Exits 1 if any phase failed.
"""
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epcomm.backends.gpu.launch import KernelSpec, current_stream  # noqa: E402
from epcomm.backends.gpu.sync import load_acquire_sys, now_ns  # noqa: E402
from epcomm.backends.gpu.reach import nvshmem  # noqa: E402


@triton.jit
def probe_put(dst, src, nbytes, signal_word, epoch, pe):
    """Program p puts chunk p of ``nbytes`` to ``pe`` and adds 1 to its signal word after the data."""
    pid = tl.program_id(0)
    chunk = nbytes // tl.num_programs(0)
    nvshmem.put_signal(dst + pid * chunk, src + pid * chunk, chunk, signal_word, 1, nvshmem.SIGNAL_ADD, pe)


@triton.jit
def probe_wait(signal_word, expected, timeout_ns, result_ptr):
    """Poll this rank's signal word (acquire) until it reaches ``expected``; result = ns waited, -1 on timeout."""
    start = now_ns()
    value = load_acquire_sys(signal_word.to(tl.int64))
    now = start
    while (value < expected) & (now - start < timeout_ns):
        value = load_acquire_sys(signal_word.to(tl.int64))
        now = now_ns()
    tl.store(result_ptr, tl.where(value >= expected, now - start, -1))


@triton.jit
def probe_send(dst, src, nbytes, signal_word, spare_word, value, pe, bases_ptr, rank):
    """What a low-latency sender does for a far peer: put, complete, then SET the peer's word
    (lane 0; the other lanes SET this rank's spare word, as masked lanes do)."""
    nvshmem.send_bytes(dst, src, nbytes, pe, bases_ptr, rank, LOOPBACK=False)
    nvshmem.complete_sends(LOOPBACK=False)
    lanes = tl.arange(0, 128)
    nvshmem.set_words(signal_word.to(tl.int64) + 0 * lanes, value + 0 * lanes, pe + 0 * lanes, lanes == 0,
                      spare_word.to(tl.int64), bases_ptr, rank, LOOPBACK=False)


PUT = KernelSpec(probe_put, ["*i8", "*i8", "i64", "*i64", "i64", "i32"], library=nvshmem.NVSHMEM)
SEND = KernelSpec(probe_send, ["*i8", "*i8", "i64", "*i64", "*i64", "i64", "i32", "*i64", "i32"],
                  library=nvshmem.NVSHMEM)
WAIT = KernelSpec(probe_wait, ["*i64", "i64", "i64", "*i64"], library=nvshmem.NVSHMEM)


def worker(rank, world, port, results):
    report = {}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        gpus = torch.cuda.device_count()
        dev = torch.device("cuda", rank % gpus)
        torch.cuda.set_device(dev)
        if world <= gpus:
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                                    timeout=datetime.timedelta(seconds=60))
        else:  # several processes per GPU: NCCL refuses that; the rendezvous only needs a store
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        import torch.distributed._symmetric_memory as symm_mem
        report["available"] = nvshmem.nvshmem_available()
        symm_mem.set_backend("NVSHMEM")
        half = 64 << 20
        buf = symm_mem.empty(2 * half, dtype=torch.uint8, device=dev)
        signals = symm_mem.empty(8, dtype=torch.int64, device=dev).zero_()
        started = time.time()
        handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        symm_mem.rendezvous(signals, dist.group.WORLD.group_name)
        report["rendezvous_s"] = round(time.time() - started, 2)
        report["peer_pointers"] = [p != 0 for p in handle.buffer_ptrs]
        src, dst = buf[:half], buf[half:]
        src.copy_((torch.arange(half, device=dev) % 251 + rank).to(torch.uint8))
        torch.cuda.synchronize()
        dist.barrier()
        peer, sender = (rank + 1) % world, (rank - 1) % world
        waited = torch.zeros(1, dtype=torch.int64, device=dev)
        stream = current_stream(dev.index)
        put, wait = PUT.bind(num_warps=4), WAIT.bind(num_warps=1)
        started = time.time()
        put.launch(32, 1, stream, dst, src, half, signals, 1, peer)
        wait.launch(1, 1, stream, signals, 32, 10 ** 10, waited)
        torch.cuda.synchronize()
        report["first_put_s"] = round(time.time() - started, 2)
        report["wait_ns"] = int(waited.item())
        report["data_ok"] = bool(torch.equal(dst, (torch.arange(half, device=dev) % 251 + sender).to(torch.uint8)))
        times = []
        for call in range(2, 12):
            dist.barrier()
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            put.launch(32, 1, stream, dst, src, half, signals, 1, peer)
            wait.launch(1, 1, stream, signals, 32 * call, 10 ** 10, waited)
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        median_ms = sorted(times)[len(times) // 2]
        report["64MiB_put_us"] = round(median_ms * 1e3, 1)
        report["GB_per_s"] = round(half / median_ms / 1e6, 1)
        # the low-latency primitives: 1 MiB of a new pattern, then signal word 1 SET to 5
        dist.barrier()
        torch.cuda.synchronize()
        mib = 1 << 20
        src[:mib].add_(7)
        bases = torch.tensor([int(p or 0) for p in handle.buffer_ptrs], dtype=torch.int64, device=dev)
        torch.cuda.synchronize()
        dist.barrier()
        SEND.bind(num_warps=4).launch(1, 1, stream, dst, src, mib, signals.data_ptr() + 8, signals.data_ptr() + 16,
                                      5, peer, bases, rank)
        wait.launch(1, 1, stream, signals.data_ptr() + 8, 5, 10 ** 10, waited)
        torch.cuda.synchronize()
        report["ll_wait_ns"] = int(waited.item())
        want = (torch.arange(mib, device=dev) % 251 + sender + 7).to(torch.uint8)
        report["ll_data_ok"] = bool(torch.equal(dst[:mib], want)) and int(waited.item()) >= 0
        report["ll_spare_word"] = int(signals[2].item())  # 5: the masked lanes' SET landed here
        # SET is a store, not an add: a second SET of the same value leaves it (a wrong SIGNAL_SET
        # code makes the library ADD instead: 10 in the peer's word, 5 x 127 masked lanes here)
        dist.barrier()
        SEND.bind(num_warps=4).launch(1, 1, stream, dst, src, mib, signals.data_ptr() + 8, signals.data_ptr() + 16,
                                      5, peer, bases, rank)
        torch.cuda.synchronize()
        dist.barrier()
        report["set_is_store"] = int(signals[1].item()) == 5 and int(signals[2].item()) == 5
        dist.barrier()
        results.put((rank, "ok", report))
    except Exception:
        results.put((rank, "error", report, traceback.format_exc()[-3000:]))


def main() -> int:
    # ranks: one per GPU, or ``--ranks N`` processes spread over the GPUs (several per GPU is only a
    # functional check: PyTorch's NVSHMEM rendezvous needs at least two ranks)
    world = int(sys.argv[sys.argv.index("--ranks") + 1]) if "--ranks" in sys.argv else max(torch.cuda.device_count(), 1)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, 29611, results)) for r in range(world)]
    for p in procs:
        p.start()
    ok = True
    for _ in range(world):
        try:
            item = results.get(timeout=240)
        except Exception:
            print("timeout: a rank did not report in 240 s")
            ok = False
            break
        print(item, flush=True)
        ok &= item[1] == "ok" and all(item[2].get(key, False) for key in ("data_ok", "ll_data_ok", "set_is_store"))
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    print("nvshmem probe:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
