"""The multi-node (nvshmem) backend's kernels on one GPU, every rank a thread of this process
(loopback transport): dispatch, cached dispatch and combine against the references
(epcomm.testing.loopback). Skipped without CUDA. The NVSHMEM puts themselves need one GPU per
process: tests/test_gpu.py runs the backend on virtual nodes where two GPUs are lent.
"""
import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")]

# (ranks, ranks per node): 2 nodes x 1, 2 x 2, 4 x 1, 1 node x 2 (no network hop), 3 x 2
TOPOLOGIES = [(2, 1), (4, 2), (4, 1), (2, 2), (6, 2)]


@pytest.mark.parametrize("ranks,per_node", TOPOLOGIES)
def test_dispatch_and_combine_against_references(ranks, per_node):
    from epcomm.testing.loopback import normal_case
    for seed, scenario in enumerate(("uniform", "skewed", "holes", "empty_rank")):
        normal_case(seed, ranks, per_node, scenario, num_experts=4 * ranks)


@pytest.mark.parametrize("ranks,per_node", [(2, 1), (4, 2)])
def test_fp8_biases_worst_tokens_alignment_and_channels(ranks, per_node):
    from epcomm.testing.loopback import normal_case
    normal_case(10, ranks, per_node, "uniform", use_fp8=True, num_experts=4 * ranks, hidden=512)
    normal_case(11, ranks, per_node, "skewed", num_bias=2, num_experts=4 * ranks, num_channels=3)
    normal_case(12, ranks, per_node, "holes", num_worst_tokens=40 * ranks, num_experts=4 * ranks)
    normal_case(13, ranks, per_node, "uniform", with_weights=False, expert_alignment=8, num_experts=4 * ranks)
    normal_case(14, ranks, per_node, "one_rank", max_tokens=300, hidden=2048, num_experts=8 * ranks, num_topk=8)
