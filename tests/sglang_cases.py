"""Rank bodies of tests/test_engine_sglang.py: SGLang's DeepEP dispatcher (token_dispatcher/deepep.py)
with SGLang's keyword names and values, through ``from deep_ep import Buffer, Config``: its
``--deepep-config`` JSON, its Buffer sizing, the normal dispatcher (``expert_alignment=128`` with
DeepGEMM, its FP8 scale formats) and the low-latency one (FP8, NVFP4) on one Buffer."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import engine_formats
from engine_cases import _close, _deep_ep, _device
from epcomm.testing import reference_combine, reference_dispatch, reference_low_latency_combine
from epcomm.testing.sweeps import _to_cpu, expert_fn, make_routing, rank_fn, world

DEEPEP_CONFIG = {  # the shape of SGLang's tuned --deepep-config files
    "normal_dispatch": {"num_sms": 8, "num_max_nvl_chunked_send_tokens": 16, "num_max_nvl_chunked_recv_tokens": 256,
                        "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 128},
    "normal_combine": {"num_sms": 8, "num_max_nvl_chunked_send_tokens": 6, "num_max_nvl_chunked_recv_tokens": 256,
                       "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 128},
}


def load_json_config(data: str):
    """SGLang's ``load_json_config``: the flag's value is JSON text or the path of a JSON file."""
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return json.loads(Path(data).read_text())


class DeepEPConfig:
    """SGLang's: ``Config(**parsed["normal_dispatch"])``, ``Config(**parsed["normal_combine"])``."""

    def __init__(self, config_str: str, Buffer, Config):
        parsed = load_json_config(config_str)
        config_dispatch, config_combine = parsed["normal_dispatch"], parsed["normal_combine"]
        self.normal_dispatch_config = Config(**config_dispatch)
        self.normal_combine_config = Config(**config_combine)
        assert config_dispatch["num_sms"] == config_combine["num_sms"]
        self.num_sms = config_dispatch["num_sms"]


def get_deepep_buffer(group, hidden_size: int, param_bytes: int, deepep_config, M: int, num_experts: int):
    """SGLang's ``DeepEPBuffer.get_deepep_buffer`` in auto mode (normal and low-latency on one Buffer)."""
    from deep_ep import Buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    hidden_bytes = hidden_size * param_bytes
    for config in (deepep_config.normal_dispatch_config or Buffer.get_dispatch_config(group.size()),
                   deepep_config.normal_combine_config or Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    num_rdma_bytes = max(Buffer.get_low_latency_rdma_size_hint(M, hidden_size, group.size(), num_experts),
                         num_rdma_bytes)
    num_qps_per_rank = max(deepep_config.num_sms, num_experts // group.size())
    return Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=num_qps_per_rank,
                  allow_mnnvl=True)


def dispatchers(form: str, config_in_file: str = "", hidden: int = 1024, async_finish: bool = True,
                return_recv_hook: bool = False):
    """Normal mode (``form``: ``bf16`` or an FP8 format of engine_formats.quantize) with
    ``expert_alignment=128``, the JSON configs, ``Buffer.capture()`` / ``async_finish``; then
    ``clean_low_latency_buffer`` and the low-latency dispatcher (NVFP4 with ``input_global_scale``
    as ``x_global_scale`` — one value per local expert — and Blackwell's ``round_scale`` /
    ``use_ue8m0`` passed along, then FP8), ``async_finish=not return_recv_hook``; then normal mode
    again. Returns the received normal-mode scales' dtype and width."""
    _deep_ep()
    from deep_ep import Buffer, Config
    R, rank = world()
    dev = _device()
    group = dist.group.WORLD
    num_experts, M = 4 * R, 8
    text = config_in_file or json.dumps(DEEPEP_CONFIG)  # a file's path (written by the test), or the JSON
    deepep_config = DeepEPConfig(text, Buffer, Config)
    buffer = get_deepep_buffer(group, hidden, 2, deepep_config, M, num_experts)
    got = None
    for step in range(2):
        got = _normal(buffer, deepep_config, form, R, rank, dev, num_experts, hidden, async_finish, step)
        buffer.clean_low_latency_buffer(M, hidden, num_experts)  # set_dispatch_mode_as_low_latency after normal
        for ll_form in ("nvfp4", "fp8"):
            _low_latency(buffer, ll_form, R, rank, dev, num_experts, M, hidden, return_recv_hook, step)
    return got


def _normal(buffer, deepep_config, form, R, rank, dev, num_experts, hidden, async_finish, step):
    from deep_ep import Buffer
    xs, topks, weights = make_routing(900 + step, "skewed", R, num_experts, 4, 16, hidden)
    sent = [xs[i] if form == "bf16" else engine_formats.quantize(xs[i].to(dev), form) for i in range(R)]
    topk_ids, topk_weights = topks[rank].to(dev), weights[rank].to(dev)
    previous_event = Buffer.capture() if async_finish else None
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \
        buffer.get_dispatch_layout(topk_ids, num_experts, previous_event=previous_event, async_finish=async_finish,
                                   allocate_on_comm_stream=previous_event is not None)
    recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle, event = buffer.dispatch(
        sent[rank], topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event, async_finish=async_finish,
        allocate_on_comm_stream=(previous_event is not None) and async_finish, expert_alignment=128,
        config=deepep_config.normal_dispatch_config)
    event.current_stream_wait() if async_finish else ()
    want = reference_dispatch([_to_cpu(s) for s in sent], topks, weights, num_experts, 128)[rank]
    received = want["recv_src_idx"].shape[0]
    assert num_recv_tokens_per_expert == want["num_recv_tokens_per_expert_list"]
    assert all(count % 128 == 0 for count in num_recv_tokens_per_expert)
    assert torch.equal(recv_topk_ids.cpu(), want["recv_topk_idx"])
    got = None
    if form == "bf16":
        rows = recv_x
        assert torch.equal(rows.cpu(), want["recv_x"])
    else:
        engine_formats.check_fp8_received(recv_x, want["recv_x"], form, received)
        got = (recv_x[1].dtype, recv_x[1].shape[1])
        rows = engine_formats.cast_back(*recv_x, form).to(torch.bfloat16)
    previous_event = Buffer.capture() if async_finish else None
    combined_x, _, event = buffer.combine(rank_fn(rank, rows), handle, async_finish=async_finish,
                                          previous_event=previous_event,
                                          allocate_on_comm_stream=previous_event is not None,
                                          config=deepep_config.normal_combine_config)
    event.current_stream_wait() if async_finish else ()
    home = xs[rank] if form == "bf16" else engine_formats.cast_back(*_to_cpu(sent[rank]), form).to(torch.bfloat16)
    _close(combined_x, reference_combine(home, topks[rank], num_experts, R, rank_fn), f"{form} combine")
    return got


def _low_latency(buffer, ll_form, R, rank, dev, num_experts, M, hidden, return_recv_hook, step):
    xs, topks, weights = make_routing(950 + step, "uniform", R, num_experts, 4, M, hidden, fixed_tokens=M)
    hidden_states, topk_ids, topk_weights = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
    num_local = num_experts // R
    input_global_scale = None
    if ll_form == "nvfp4":  # the quant config's input_global_scale: (l,), equal values
        input_global_scale = torch.full((num_local,), 448 * 6 / max(float(x.float().abs().max()) for x in xs),
                                        device=dev)
    use_nvfp4 = input_global_scale is not None
    use_fp8 = not use_nvfp4
    blackwell = True  # ENABLE_JIT_DEEPGEMM and DEEPGEMM_BLACKWELL: round_scale / use_ue8m0 passed in any case
    packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
        hidden_states, topk_ids, M, num_experts, use_fp8=use_fp8, **(dict(use_nvfp4=True) if use_nvfp4 else dict()),
        **(dict(x_global_scale=input_global_scale) if input_global_scale is not None else dict()),
        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook, round_scale=blackwell,
        use_ue8m0=blackwell)
    hook() if return_recv_hook else event.current_stream_wait()
    if use_nvfp4:
        engine_formats.check_nvfp4_received(packed_recv_hidden, packed_recv_count, handle, xs, topks,
                                            input_global_scale[:1], rank)
        expert_out = engine_formats.nvfp4_expert_outputs(packed_recv_hidden, input_global_scale[:1], rank, expert_fn)
        seen = engine_formats.nvfp4_expert_view(xs[rank], input_global_scale[:1]).to(torch.bfloat16)
        want = reference_low_latency_combine(seen, topks[rank], weights[rank], expert_fn, False)
    else:
        values, scales = packed_recv_hidden
        assert scales.dtype == torch.int32 and scales.shape[2] == hidden // 512 and scales.stride(1) == 1
        rows = torch.stack([engine_formats.cast_back(values[e], scales[e], "sglang_blackwell") for e in range(num_local)])
        local = rank * num_local + torch.arange(num_local, device=rows.device)
        expert_out = (rows * ((local.float() + 1) / 8)[:, None, None]).to(torch.bfloat16)
        want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, True, True)
    combined_hidden_states, event, hook = buffer.low_latency_combine(
        x=expert_out, topk_idx=topk_ids, topk_weights=topk_weights, handle=handle,
        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
    hook() if return_recv_hook else event.current_stream_wait()
    _close(combined_hidden_states, want, f"low-latency {ll_form} round trip")
