"""The nvlink workspace's layout (backends/gpu/workspace.py), on CPU memory: the low-latency
halves with and without the nvshmem backend's staging area, the size hint, the scratch word."""
import pytest
import torch

from epcomm.backends.gpu import workspace as W
from epcomm.errors import EPInputError


def _workspace(num_ranks, num_ll_bytes, staging, normal=False, rank=0):
    size = W.Workspace.size_for(num_ranks, 0, num_ll_bytes, normal=normal)
    memory = (torch.zeros(size, dtype=torch.uint8), torch.zeros(num_ranks, dtype=torch.int64), lambda: None)
    return W.Workspace(None, torch.device("cpu"), 0, num_ll_bytes, memory=memory, normal=normal, staging=staging,
                       rank=rank, num_ranks=num_ranks)


@pytest.mark.parametrize("num_ranks,num_experts,max_tokens,hidden", [(2, 16, 128, 7168), (16, 256, 128, 7168),
                                                                    (4, 8, 1, 128), (8, 288, 64, 2560)])
@pytest.mark.parametrize("staging", [False, True])
def test_low_latency_layout_fits_the_hint(num_ranks, num_experts, max_tokens, hidden, staging):
    """With num_rdma_bytes from the hint, every format and top-k up to 32 fits; the parts of a half
    are disjoint and in order; the staging area holds M*K messages and E*M combine rows."""
    ws = _workspace(num_ranks, W.low_latency_bytes(max_tokens, hidden, num_ranks, num_experts), staging)
    assert ws.size == ws.buffer.numel() and ws.ll_half > 0
    for num_topk in (1, 8, min(32, num_experts)):
        for fp8, ue8m0 in ((False, False), (True, False), (True, True)):
            if ue8m0 and hidden % 512:
                continue
            layout = ws.ll_layout(num_experts, max_tokens, hidden, num_topk, fp8, ue8m0)
            recv_bytes = num_experts * max_tokens * layout.msg_bytes
            assert layout.counts == 0 and layout.recv >= num_experts * 8
            assert layout.combine >= layout.recv + recv_bytes
            end = layout.combine + max_tokens * num_topk * hidden * 2
            if staging:
                assert layout.stage >= end
                assert layout.stage + max(max_tokens * num_topk * layout.msg_bytes,
                                          num_experts * max_tokens * hidden * 2) <= ws.ll_half
                assert layout.stage % 16 == 0 and layout.msg_bytes % 16 == 0
            else:
                assert layout.stage == 0 and end <= ws.ll_half


def test_low_latency_layout_too_small_names_the_argument_and_size():
    hint = W.low_latency_bytes(64, 2048, 4, 32)
    ws = _workspace(4, hint // 4, staging=True)
    with pytest.raises(EPInputError, match="num_max_dispatch_tokens_per_rank") as err:
        ws.ll_layout(32, 64, 2048, 8, False, False)
    assert "num_rdma_bytes >=" in str(err.value)


def test_staging_needs_more_than_stores_alone():
    """The nvlink backend keeps its old need (no staging); the hint covers the nvshmem backend's."""
    msg = W.ll_message_bytes(7168, False, False)[2]
    plain, _, no_stage = W.ll_half_bytes(256, 128, 7168, 8, msg)
    staged, combine, stage = W.ll_half_bytes(256, 128, 7168, 8, msg, staging=True)
    assert no_stage == 0 and stage > combine and staged > plain
    assert W.low_latency_bytes(128, 7168, 16, 256) >= 2 * staged


def test_size_for_matches_the_workspace_and_the_scratch_word_is_free():
    for normal in (False, True):
        ws = _workspace(8, 1 << 20, staging=False, normal=normal)
        assert ws.size == W.Workspace.size_for(8, 0, 1 << 20, normal=normal)
        assert (ws.ll_offset == W.FLAGS_BYTES) == (not normal)
    # the scratch word lies after the largest flag region and before the fingerprints
    max_ranks = W.SPARE_WORD // (8 * W.NUM_FLAG_SETS)
    assert W.NUM_FLAG_SETS * max_ranks * 8 <= W.SPARE_WORD < W.FINGERPRINTS_OFFSET
    ws = _workspace(4, 1 << 20, staging=True)
    assert ws.spare_word == ws.local_base + W.SPARE_WORD


def test_nvshmem_modes_share_the_allocation():
    """On nvshmem the low-latency workspace starts after normal mode's fixed signal words and the
    allocation is num_rdma_bytes unless the low-latency workspace needs more (DeepEP's sharing)."""
    from epcomm.backends.gpu.normal.two_level.areas import allocation_bytes, low_latency_start, preamble
    R, k = 16, 8
    start = low_latency_start(R, k)
    assert start >= preamble(R, k).data and start % W.ALIGN == 0
    ll = W.low_latency_bytes(128, 7168, R, 256)
    need = start + W.Workspace.size_for(R, 0, ll, normal=False)
    assert allocation_bytes(ll, ll, R, k) == need < ll + (1 << 20)
    assert allocation_bytes(4 * ll, ll, R, k) == 4 * ll
    assert allocation_bytes(ll, 0, R, k) == ll


def test_count_words_never_lie_where_another_shape_puts_messages():
    """A receiver takes a count word whose epoch field is at least its call's: so no call shape may
    put message, combine or staging bytes where any other shape's count words are (the 16-rank
    fuzz read an earlier 16-expert call's message bytes as the count of a 64-expert call)."""
    R, M, H = 16, 16, 512
    ws = _workspace(R, W.low_latency_bytes(M, H, R, 4 * R), staging=True)
    shapes = [(E, K, fp8, ue8m0) for E in (R, 2 * R, 4 * R) for K in (1, 4) for fp8, ue8m0 in
              ((False, False), (True, False), (True, True))]
    count_end = max(ws.ll_layout(E, M, H, K, fp8, ue8m0).counts + E * 8 for E, K, fp8, ue8m0 in shapes)
    for E, K, fp8, ue8m0 in shapes:
        layout = ws.ll_layout(E, M, H, K, fp8, ue8m0)
        assert layout.recv >= count_end and layout.combine >= count_end, (E, K, fp8)
        assert layout.stage == 0 or layout.stage >= count_end
    # the same place for every shape, up to the largest expert count low-latency mode takes
    assert {ws.ll_layout(E, M, H, K, f, u).recv for E, K, f, u in shapes} == {W.align(W.LL_COUNT_BYTES)}
    with pytest.raises(EPInputError, match="num_experts"):
        ws.ll_layout(W.LL_MAX_EXPERTS + R, M, H, 4, False, False)
