"""Host-side logic of the nvlink backend that needs no GPU: the mailbox the kernels report through,
and the launch layer's checks. Skipped where Triton is not installed (CI installs only torch)."""
import pytest

pytest.importorskip("triton")

from epcomm.backends.nvlink.normal import cdiv, copy_block_shape, p2  # noqa: E402
from epcomm.backends.nvlink.sync import HostMailbox  # noqa: E402
from epcomm.errors import EPInputError, EPTimeoutError  # noqa: E402


def test_mailbox_quiet_by_default():
    box = HostMailbox(4, 8, pinned=False)
    box.raise_pending(0, 1.0)  # nothing reported: no error


def test_mailbox_timeout_names_peers_and_stays_raised():
    box = HostMailbox(4, 8, pinned=False)
    box.view[0] = 1  # pending
    box.view[1 + 2] = 1  # peer 2 timed out
    for _ in range(2):  # sticky: the buffer cannot be trusted afterwards
        with pytest.raises(EPTimeoutError) as err:
            box.raise_pending(0, 5.0)
        assert err.value.peers == [2]


def test_mailbox_dropped_ids_raise_once_naming_topk_idx():
    box = HostMailbox(2, 8, pinned=False)
    box.view[0] = 1
    box.view[2 + 1] = 3  # three ids outside [-1, E)
    with pytest.raises(EPInputError, match="topk_idx"):
        box.raise_pending(0, 1.0)
    box.raise_pending(0, 1.0)  # reported once; the buffer stays usable


def test_mailbox_notify_wait_is_bounded():
    box = HostMailbox(2, 8, pinned=False)
    with pytest.raises(EPTimeoutError, match="count exchange"):
        box.wait_notify(box.next_sequence(), 0, timeout_s=0.01)


def test_mailbox_notify_returns_counts():
    box = HostMailbox(2, 8, pinned=False)
    sequence = box.next_sequence()
    notify = 2 + 2
    box.view[notify + 1], box.view[notify + 2] = 17, 9
    box.view[notify + 3:notify + 6] = [4, 8, 5]
    box.view[notify] = sequence  # published last, as the kernel does
    num_recv, max_tokens, per_expert = box.wait_notify(sequence, 0, timeout_s=1.0)
    assert (num_recv, max_tokens, per_expert[:3].tolist()) == (17, 9, [4, 8, 5])


def test_host_arithmetic_helpers():
    assert [p2(n) for n in (0, 1, 2, 3, 128, 129)] == [1, 1, 2, 4, 128, 256]
    assert [cdiv(a, b) for a, b in ((0, 4), (1, 4), (8, 4), (9, 4))] == [0, 1, 2, 3]
    assert copy_block_shape(1792) == (8, 2048)  # H=7168 bf16 rows: 8 whole rows per step
    assert copy_block_shape(40000) == (1, 16384)
