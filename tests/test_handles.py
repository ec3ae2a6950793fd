"""Handles laid out as DeepEP's (issue 51): code that indexes or unpacks a DeepEP handle reads the same
fields from epcomm's; epcomm's extras are attributes. Unit tests here; the Buffer-made handles on
4 CPU ranks (one node and virtual nodes) in handle_cases.py."""
import copy
import pickle

import pytest
import torch

import handle_cases
from epcomm.handle import INTERNODE_FIELDS, INTRANODE_FIELDS, DeviceCount, DispatchHandle, LowLatencyHandle, channel_prefix, \
    channel_slots
from epcomm.testing.sweeps import assert_same_handle


def _handle(num_tokens=10, R=4, seed=0, rank=1):
    g = torch.Generator().manual_seed(seed)
    in_rank = torch.rand(num_tokens, R, generator=g) > 0.5
    prefix = torch.randint(0, 5, (R, R), generator=g, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = int(prefix[-1, rank])
    return DispatchHandle(prefix, torch.arange(rows, dtype=torch.int32), in_rank, rows, rows, "state", None)


def test_one_node_handle_has_deep_eps_six_fields_in_order():
    handle = _handle().laid_out(rank=1, ranks_per_node=4, num_channels=3)
    assert len(handle) == 6 and handle.deep_ep_fields == INTRANODE_FIELDS
    rank_prefix_matrix, channel_prefix_matrix, recv_channel, recv_src_idx, is_token_in_rank, send_head = handle
    assert rank_prefix_matrix is handle.rank_prefix_matrix and handle[0] is handle.rank_prefix_matrix
    assert recv_src_idx is handle.recv_src_idx and handle[4] is handle.is_token_in_rank is is_token_in_rank
    assert channel_prefix_matrix.shape == (4, 3) and send_head.shape == (10, 4) and recv_channel is None
    assert handle[-1] is send_head and handle[:2] == (rank_prefix_matrix, channel_prefix_matrix)
    assert handle.backend_state == "state" and handle.num_recv_rows == handle.recv_src_idx.shape[0]


def test_a_handle_across_nodes_has_deep_eps_ten_fields_in_order():
    handle = _handle(R=4, rank=2).laid_out(rank=2, ranks_per_node=2, num_channels=2)
    assert len(handle) == 10 and handle.deep_ep_fields == INTERNODE_FIELDS
    fields = list(handle)
    assert fields[0] is handle.is_token_in_rank
    assert torch.equal(handle[-4], handle.rank_prefix_matrix[:, 2])  # recv_gbl_rank_prefix_sum
    assert handle[-4][-1].item() == handle.recv_src_idx.shape[0]  # DeepEP's test: the last is the rows received
    assert handle[1].shape == (2, 2) and handle[2].shape == (4, 2) and handle[8].shape == (10, 2)
    assert [fields[i] for i in (3, 4, 5, 9)] == [None] * 4
    meta = handle[7].view(torch.int32)
    assert handle[7].dtype == torch.uint8 and handle[7].shape == (handle.recv_src_idx.shape[0], 8)
    sources = torch.searchsorted(handle.rank_prefix_matrix[:, 2].long(), torch.arange(meta.shape[0]), right=True)
    assert torch.equal(meta[:, 0].long(), sources // 2) and (meta[:, 1] == 1).all()  # rank 2: bit 0 of node 1


def test_handles_of_the_same_dispatch_compare_equal_across_layouts():
    """The GPU suite's check of a virtual-nodes dispatch against the one-node reference
    (sweeps.assert_same_handle) compares fields by name: the two handles' [0] differ in meaning."""
    one_node = _handle(R=4, rank=2).laid_out(rank=2, ranks_per_node=4, num_channels=2)
    across = _handle(R=4, rank=2).laid_out(rank=2, ranks_per_node=1, num_channels=2)
    assert one_node[0] is one_node.rank_prefix_matrix and across[0] is across.is_token_in_rank
    assert_same_handle(across, one_node, "virtual nodes")
    other = _handle(R=4, rank=2, seed=1).laid_out(rank=2, ranks_per_node=4, num_channels=2)
    with pytest.raises(AssertionError, match="rank_prefix_matrix"):
        assert_same_handle(other, one_node)


def test_channel_fields_follow_deep_eps_channel_split():
    """Channel c of T tokens and C channels sends tokens [c*ceil(T/C), (c+1)*ceil(T/C))."""
    in_rank = torch.tensor([[1, 0], [1, 1], [0, 1], [1, 1], [1, 0], [0, 0], [1, 1]], dtype=torch.bool)
    assert channel_prefix(in_rank, 3).tolist() == [[2, 4, 5], [2, 3, 4]]  # inclusive, per destination
    assert channel_slots(in_rank, 3).t().tolist() == [[0, 1, -1, 0, 1, -1, 0], [-1, 0, 1, 0, -1, -1, 0]]


def test_a_handle_keeps_its_first_layout_and_replace_keeps_it():
    handle = _handle(rank=0).laid_out(rank=0, ranks_per_node=2, num_channels=4)
    assert handle.laid_out(rank=3, ranks_per_node=4, num_channels=1) is handle and len(handle) == 10
    other = handle._replace(expert_major="mapping")
    assert other.expert_major == "mapping" and len(other) == 10 and other.rank == 0 and other.num_channels == 4
    assert len(_handle()) == 6  # not laid out yet: one node


def test_a_device_count_is_made_on_the_first_read_kept_copied_and_settable():
    """A backend that has the received count only on the device (num_worst_tokens) gives a
    DeviceCount: the 0-dim view is made when num_recv_tokens is read (host time per call saved),
    once. A deep copy made before that read reads its own copy of the words, as one made after it
    does; the field can still be assigned, as before it was lazy."""
    words = torch.tensor([7, 40], dtype=torch.int32)

    def handle():
        return DispatchHandle(torch.zeros(2, 2, dtype=torch.int32), torch.arange(4, dtype=torch.int32),
                              torch.zeros(3, 2, dtype=torch.bool), DeviceCount(words, 1), 4, words)
    lazy = handle()
    unread_copy, pickled = copy.deepcopy(lazy), pickle.loads(pickle.dumps(lazy))
    assert lazy.num_recv_tokens.dim() == 0 and int(lazy.num_recv_tokens) == 40
    read = lazy.num_recv_tokens
    words[1] = 9  # (a view: it reads what the kernels wrote)
    assert lazy.num_recv_tokens is read and int(read) == 9
    assert int(unread_copy.num_recv_tokens) == 40 and int(pickled.num_recv_tokens) == 40
    assert unread_copy.num_recv_tokens.data_ptr() == unread_copy.backend_state.data_ptr() + 4  # (its own words)
    assert lazy._replace(expert_major="m").num_recv_tokens is read
    lazy.num_recv_tokens = 3
    assert lazy.num_recv_tokens == 3


def test_low_latency_handle_is_deep_eps_five_tuple_with_the_state_as_an_attribute():
    src_info, layout = torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int64)
    handle = LowLatencyHandle(src_info, layout, 4, 256, 8, "state")
    assert isinstance(handle, tuple) and len(handle) == 5 and tuple(handle)[2:] == (4, 256, 8)
    recv_src_info, recv_layout_range, M, hidden, num_experts = handle
    assert recv_src_info is handle.recv_src_info and handle[1] is handle.recv_layout_range
    assert (M, hidden, num_experts) == (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
    assert handle.backend_state == "state"
    for again in (handle._replace(hidden=128), copy.copy(handle), pickle.loads(pickle.dumps(handle))):
        assert again.backend_state == "state" and len(again) == 5
    assert handle._replace(hidden=128)[3] == 128


@pytest.mark.parametrize("ranks_per_node", [4, 2])
def test_buffer_handles_are_laid_out_for_its_nodes(pools, ranks_per_node):
    assert pools.get(4).run(handle_cases.normal_handles, ranks_per_node) == [True] * 4


def test_buffer_low_latency_handle_has_five_fields(pools):
    assert pools.get(4).run(handle_cases.low_latency_handle) == [True] * 4
