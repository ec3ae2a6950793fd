"""What a user's own tests import: routing generators (:mod:`.routing`), the single-process
reference (:mod:`.reference`) and the multi-process launcher (:mod:`.launcher`). Two more modules
stay in the package for a reason their docstrings give: :mod:`.sweeps` (``epcomm check`` runs it)
and :mod:`.two_level` (the executable statement of the multi-node plan). The project's own
scenario suites — the loopback suite, the fault sequence, DeepEP's internode usage — live with its
tests (tests/loopback_suite.py, tests/sequence_cases.py, tests/internode_cases.py)."""
from .launcher import RankFailure, WorkerPool, default_world, run_distributed
from .reference import (reference_combine, reference_dispatch, reference_low_latency_combine,
                        reference_low_latency_dispatch)
from .routing import (group_limited_topk, random_weights, single_rank_topk, skewed_topk, uniform_topk, with_holes)

__all__ = ["RankFailure", "WorkerPool", "default_world", "run_distributed", "reference_dispatch", "reference_combine",
           "reference_low_latency_dispatch", "reference_low_latency_combine", "uniform_topk", "skewed_topk",
           "with_holes", "single_rank_topk", "group_limited_topk", "random_weights"]
