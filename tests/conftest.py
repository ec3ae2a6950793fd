import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # ep_cases must be importable by spawned ranks
# the opt-in `deep_ep` package (compat/deep_ep), for the engine tests' `import deep_ep`
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat", "deep_ep"))

from epcomm.testing import WorkerPool  # noqa: E402


class Pools:
    """One long-lived gloo WorkerPool per world size, shared by the whole session."""

    def __init__(self):
        self._pools = {}

    def get(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.closed:
            pool = WorkerPool(world_size)
            self._pools[world_size] = pool
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
