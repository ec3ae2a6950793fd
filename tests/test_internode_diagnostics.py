"""The messages of internode_cases.py's checks (run on GPUs) are worked out on the CPU: a
failure on a GPU bed must say which sources' rows were wrong, and the state behind it."""
import types

import torch

from internode_cases import _gpu_state, _rows_differ


def test_rows_differ_counts_the_wrong_rows_per_source():
    want = torch.arange(10 * 4, dtype=torch.bfloat16).reshape(10, 4) + 1
    got = want.clone()
    got[3:5] = 0  # source 1 (rows 2..4) loses two rows
    got[9] = 0  # source 2 (rows 5..9) loses one
    text = _rows_differ(got, want, torch.tensor([2, 5, 10]))
    assert text.startswith("3 of 10 rows differ, first row 3")
    assert "per source (rows differing / received): [(0, 2), (2, 3), (1, 5)]" in text
    assert _rows_differ(want, want.clone(), torch.tensor([2, 5, 10])) == ""


def test_gpu_state_says_the_epochs_and_whether_the_peer_table_maps_this_rank():
    buffer_memory = torch.zeros(64, dtype=torch.uint8)
    workspace = types.SimpleNamespace(buffer=buffer_memory, bases=torch.tensor([buffer_memory.data_ptr(), 0]))
    backend = types.SimpleNamespace(state=torch.arange(16), ws=workspace)
    text = _gpu_state(types.SimpleNamespace(_backend=backend, rank=0))
    assert "[0, 1, 2, 3, 4, 5, 6, 7]" in text and "is the buffer: True" in text and "peers unmapped: [1]" in text
    assert _gpu_state(types.SimpleNamespace(_backend=types.SimpleNamespace())) == ""  # (the CPU reference)
