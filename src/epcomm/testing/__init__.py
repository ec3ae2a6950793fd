"""Test helpers: routing generators, a single-process reference, and a multi-process launcher."""
from .launcher import RankFailure, WorkerPool, default_world, run_distributed
from .reference import (reference_combine, reference_dispatch, reference_low_latency_combine,
                        reference_low_latency_dispatch)
from .routing import (group_limited_topk, random_weights, single_rank_topk, skewed_topk, uniform_topk, with_holes)

__all__ = ["RankFailure", "WorkerPool", "default_world", "run_distributed", "reference_dispatch", "reference_combine",
           "reference_low_latency_dispatch", "reference_low_latency_combine", "uniform_topk", "skewed_topk",
           "with_holes", "single_rank_topk", "group_limited_topk", "random_weights"]
