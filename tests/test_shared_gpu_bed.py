"""The CPU-checkable parts of the many-ranks-on-one-GPU bed (tests/test_shared_gpu.py): the
group-limited routing DeepEP's internode tests use, and the automatic backend's refusal of the
nvlink backend where ranks share a GPU (its symmetric memory cannot serve them)."""
import torch

from epcomm.backends.nvlink import one_host_one_gpu_each
from epcomm.testing import group_limited_topk


def test_group_limited_routing_stays_within_the_best_groups():
    g = torch.Generator().manual_seed(3)
    topk = group_limited_topk(500, 256, 8, num_groups=8, topk_groups=2, generator=g)
    assert topk.shape == (500, 8) and topk.dtype == torch.int64
    assert bool(((topk >= 0) & (topk < 256)).all())
    groups = topk // 32
    assert all(len(set(row)) <= 2 for row in groups.tolist()), "a token reached more than 2 node groups"
    assert all(len(set(row)) == 8 for row in topk.tolist()), "experts repeat within a token"


def test_group_limited_routing_with_fewer_groups_than_asked():
    topk = group_limited_topk(10, 32, 4, num_groups=1, topk_groups=2, generator=torch.Generator().manual_seed(0))
    assert topk.shape == (10, 4) and bool(((topk >= 0) & (topk < 32)).all())


def test_nvlink_needs_one_host_and_a_gpu_per_rank():
    assert one_host_one_gpu_each([("a", "GPU-0"), ("a", "GPU-1")])
    assert not one_host_one_gpu_each([("a", "GPU-0"), ("a", "GPU-0")]), "two ranks on one GPU (MPS)"
    assert not one_host_one_gpu_each([("a", "GPU-0"), ("b", "GPU-1")]), "two hosts"
