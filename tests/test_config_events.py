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


# ------------------------------------------------------------------ DeepEP's Config names (issue 51)
_SGLANG_DEEPEP_CONFIG = """{
  "normal_dispatch": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 16, "num_max_nvl_chunked_recv_tokens": 256,
                      "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 128},
  "normal_combine": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6, "num_max_nvl_chunked_recv_tokens": 256,
                     "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 128}
}"""


def _sglang_load_json_config(data: str):
    """SGLang's ``load_json_config``: ``--deepep-config`` is a JSON string or the path of a file."""
    import json
    import pathlib
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return json.loads(pathlib.Path(data).read_text())


def test_config_takes_deep_eps_keyword_names_positional_order_and_defaults():
    by_name = epcomm.Config(num_sms=24, num_max_nvl_chunked_send_tokens=16, num_max_nvl_chunked_recv_tokens=288,
                            num_max_rdma_chunked_send_tokens=20, num_max_rdma_chunked_recv_tokens=128)
    assert by_name == epcomm.Config(24, 16, 288, 20, 128)
    assert (by_name.num_max_nvl_chunked_send_tokens, by_name.nvl_chunked_recv_tokens,
            by_name.rdma_chunked_send_tokens, by_name.num_max_rdma_chunked_recv_tokens) == (16, 288, 20, 128)
    assert epcomm.Config() == epcomm.Config(20, 6, 256, 6, 256)  # DeepEP's defaults
    assert epcomm.Config(24, nvl_chunked_send_tokens=8) == epcomm.Config(24, 8)  # epcomm's short names still work
    import inspect
    assert list(inspect.signature(epcomm.Config).parameters)[:5] == [
        "num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
        "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"]
    with pytest.raises(TypeError):
        epcomm.Config(24, nvl_chunked_send_tokens=8, num_max_nvl_chunked_send_tokens=8)
    with pytest.raises(TypeError):
        epcomm.Config(24, chunked_send_tokens=8)
    with pytest.raises(epcomm.EPInputError, match="num_max_rdma_chunked_send_tokens"):
        epcomm.Config(num_max_rdma_chunked_send_tokens=300, num_max_rdma_chunked_recv_tokens=128)


@pytest.mark.parametrize("as_file", [False, True])
def test_sglang_deepep_config_json_loads_as_sglang_loads_it(tmp_path, as_file):
    """SGLang's ``--deepep-config``: ``Config(**parsed["normal_dispatch"])`` and
    ``Config(**parsed["normal_combine"])``, the text given inline or as a file path."""
    data = _SGLANG_DEEPEP_CONFIG
    if as_file:
        (tmp_path / "deepep.json").write_text(data)
        data = str(tmp_path / "deepep.json")
    parsed = _sglang_load_json_config(data)
    dispatch, combine = epcomm.Config(**parsed["normal_dispatch"]), epcomm.Config(**parsed["normal_combine"])
    assert dispatch == epcomm.Config(24, 16, 256, 6, 128) and combine == epcomm.Config(24, 6, 256, 6, 128)
    assert parsed["normal_dispatch"]["num_sms"] == dispatch.num_sms == combine.num_sms
    for config in (dispatch, combine):  # what SGLang sizes its Buffer with
        assert config.get_nvl_buffer_size_hint(7168 * 2, 16) > 0 and config.get_rdma_buffer_size_hint(7168 * 2, 16) > 0


def test_rdma_size_hint_is_the_multi_node_workspace_for_the_configs_batch():
    """0 on one node (DeepEP's nodes of 8); across nodes the nvshmem backend's workspace in which
    every rank dispatches num_sms/2 * num_max_rdma_chunked_recv_tokens BF16 tokens (or num_tokens)."""
    from epcomm.backends.gpu.normal.two_level.areas import combine_layout, dispatch_layout
    from epcomm.backends.nvshmem import bytes_for_tokens
    config = epcomm.Buffer.get_dispatch_config(16)
    hidden = 7168
    assert config.get_rdma_buffer_size_hint(hidden * 2, 8) == 0
    hint = config.get_rdma_buffer_size_hint(hidden * 2, 16)
    tokens = config.num_sms // 2 * config.num_max_rdma_chunked_recv_tokens
    assert hint == bytes_for_tokens(tokens, 16, 8, 256, hidden, 32)
    assert dispatch_layout(hint, 16, 8, 256, config.num_sms // 2, 2 * hidden, 0, 8).token_cap >= tokens
    assert combine_layout(hint, 16, 8, hidden, 8).token_cap >= tokens
    assert config.get_rdma_buffer_size_hint(hidden * 2, 16, num_tokens=4 * tokens) > hint
    assert config.get_rdma_buffer_size_hint(hidden * 2, 16, ranks_per_node=4) > hint  # 4 nodes, not 2
    with pytest.raises(epcomm.EPInputError, match="num_ranks"):
        config.get_rdma_buffer_size_hint(hidden * 2, 12)


def test_rdma_size_hint_loads_no_kernels():
    import subprocess
    import sys
    code = ("import sys, epcomm; epcomm.Config().get_rdma_buffer_size_hint(4096, 32); "
            "print('triton' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr[-2000:]
