"""The compile lock (backends/gpu/compile_lock.py): one process per host compiles a kernel
specialisation at a time — 16 ranks compiling the same NVSHMEM-linked kernel at once made one
call outlast its peers' timeout."""
import multiprocessing as mp
import os
import time

from epcomm.backends.gpu.compile_lock import compile_lock


def _hold(folder, key, seconds, queue, ready):
    ready.wait(timeout=120)  # every process imported (seconds apart on a loaded host) before any lock
    with compile_lock(key, folder):
        start = time.monotonic()
        time.sleep(seconds)
        queue.put((start, time.monotonic()))


def _spans(folder, keys, seconds=0.3):
    ctx = mp.get_context("spawn")
    queue, ready = ctx.Queue(), ctx.Barrier(len(keys))
    procs = [ctx.Process(target=_hold, args=(folder, key, seconds, queue, ready)) for key in keys]
    for proc in procs:
        proc.start()
    spans = sorted(queue.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return spans


def test_processes_compiling_the_same_specialisation_take_turns(tmp_path):
    spans = _spans(str(tmp_path), ["kernel:A", "kernel:A", "kernel:A"])
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end - 1e-3, spans  # no two inside at once


def test_different_specialisations_compile_side_by_side(tmp_path):
    (start_a, end_a), (start_b, end_b) = _spans(str(tmp_path), ["kernel:A", "kernel:B"], seconds=1.0)
    assert start_b < end_a, "two different keys waited for each other"


def test_without_a_writable_folder_it_compiles_unlocked(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder should be: no lock file can be made
    with compile_lock("kernel:A", str(blocker / "locks")):
        pass
