"""The multi-process launcher: results, failure reporting, timeouts."""
import pytest

import ep_cases
import epcomm
from epcomm.testing import RankFailure, WorkerPool, run_distributed


def test_results_in_rank_order():
    assert run_distributed(ep_cases.echo_rank, 3) == [(0, 3), (1, 3), (2, 3)]


def test_failure_names_rank_and_traceback():
    with WorkerPool(2) as pool:
        with pytest.raises(RankFailure) as info:
            pool.run(ep_cases.raise_on_rank, 1)
        assert info.value.rank == 1 and "planted failure on rank 1" in str(info.value)
        assert pool.closed
        with pytest.raises(epcomm.EPError, match="closed"):
            pool.run(ep_cases.echo_rank)


def test_timeout_names_ranks():
    with WorkerPool(2) as pool:
        with pytest.raises(epcomm.EPTimeoutError) as info:
            pool.run(ep_cases.sleep_forever, timeout_s=2)
        assert info.value.peers == [0, 1]


def test_programs_per_sm_counts_threads_registers_and_shared_memory():
    pytest.importorskip("triton")
    from epcomm.backends.gpu.launch import programs_per_sm
    # H100/H200: 2048 threads, 64K registers, 228 KB shared memory per SM
    assert programs_per_sm(8, 32, 0, 2048, 65536, 233472) == 8  # threads bound
    assert programs_per_sm(8, 128, 0, 2048, 65536, 233472) == 2  # registers bound
    assert programs_per_sm(8, 125, 0, 2048, 65536, 233472) == 2  # registers round up to 8 per thread
    assert programs_per_sm(4, 32, 100_000, 2048, 65536, 233472) == 2  # shared memory bound
    assert programs_per_sm(16, 255, 0, 2048, 65536, 233472) == 1  # never below one


def test_a_port_taken_before_the_store_listens_is_replaced(monkeypatch):
    """Another process may take the chosen port between _free_port() and rank 0's store (seen on a
    GPU machine running benchmarks back to back): the pool starts again on a new port."""
    import socket

    from epcomm.testing import launcher
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    free = launcher._free_port
    monkeypatch.setattr(launcher, "_free_port", lambda: next(ports, None) or free())
    try:
        assert run_distributed(ep_cases.echo_rank, 2) == [(0, 2), (1, 2)]
    finally:
        taken.close()
