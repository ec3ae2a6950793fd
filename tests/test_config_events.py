"""Config defaults and validation, EventOverlap on CPU, error types."""
import pytest

import epcomm
from epcomm.events import EventOverlap


def test_tuned_configs():
    for num_ranks in (1, 2, 4, 8, 16):
        for cfg in (epcomm.Buffer.get_dispatch_config(num_ranks), epcomm.Buffer.get_combine_config(num_ranks)):
            assert isinstance(cfg, epcomm.Config) and cfg.num_sms % 2 == 0
            assert cfg.get_nvl_buffer_size_hint(7168 * 2, num_ranks) > 0
    with pytest.raises(epcomm.EPInputError):
        epcomm.Buffer.get_dispatch_config(0)


def test_set_num_sms_changes_defaults():
    old = epcomm.Buffer.get_dispatch_config(8).num_sms
    try:
        epcomm.Buffer.set_num_sms(24)
        assert epcomm.Buffer.get_dispatch_config(8).num_sms == 24
        assert epcomm.Buffer.get_combine_config(8).num_sms == 24
    finally:
        epcomm.Buffer.set_num_sms(old)


def test_config_rejects_bad_values():
    with pytest.raises(epcomm.EPInputError, match="num_sms"):
        epcomm.Config(num_sms=0)
    with pytest.raises(epcomm.EPInputError, match="rdma_chunked_send_tokens"):
        epcomm.Config(20, 6, 256, 300, 256)


def test_low_latency_size_hint_grows():
    small = epcomm.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    big = epcomm.Buffer.get_low_latency_rdma_size_hint(256, 7168, 8, 256)
    assert 0 < small < big and small % 128 == 0


def test_event_overlap_on_cpu():
    event = EventOverlap()
    event.current_stream_wait()
    event.synchronize()
    with event:
        pass
    assert isinstance(epcomm.Buffer.capture(), EventOverlap)


def test_error_hierarchy():
    err = epcomm.EPInputError("x", "bad")
    assert isinstance(err, ValueError) and isinstance(err, epcomm.EPError) and err.argument == "x"
    timeout = epcomm.EPTimeoutError("waited", peers=[3, 1])
    assert isinstance(timeout, TimeoutError) and timeout.peers == [1, 3] and "[1, 3]" in str(timeout)


def test_synchronous_scope_runs_inline():
    """A synchronous call without previous_event runs on the caller's stream (no stream hops);
    async_finish or previous_event use the comm stream."""
    from epcomm.events import StreamScope
    assert StreamScope(None, None, False).inline
    assert StreamScope(object(), None, False).inline
    assert not StreamScope(object(), None, True).inline
    assert not StreamScope(object(), EventOverlap(None), False).inline
    with StreamScope(None, None, True) as scope:
        scope.keep()
    assert scope.event_overlap().event is None


def test_submodules_after_a_plain_import():
    """The README's ``epcomm.autograd.dispatch`` / ``epcomm.nn.MoE`` after ``import epcomm``."""
    import subprocess
    import sys
    code = "import epcomm; print(epcomm.autograd.dispatch.__name__, epcomm.nn.MoE.__name__)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["dispatch", "MoE"], run.stderr[-2000:]


def test_host_tensors_name_their_device_under_another_default():
    """What epcomm keeps on the host is made there whatever
    ``torch.set_default_device`` says (here "meta", which a CPU machine has). The mailbox module
    needs Triton (not in the CPU CI's install): checked where it is present."""
    import importlib.util

    import torch
    from epcomm.backends.gpu.normal.two_level.hierarchy import channel_bounds
    torch.set_default_device("meta")
    try:
        assert channel_bounds(10, 3).device.type == "cpu"
        if importlib.util.find_spec("triton") is not None:
            from epcomm.backends.gpu.mailbox import HostMailbox
            mailbox = HostMailbox(2, 8, pinned=False)
            assert mailbox.words.device.type == "cpu" and int(mailbox.view[0]) == 0
    finally:
        torch.set_default_device(None)
