"""Rank bodies of tests/test_engine_vllm.py: vLLM's DeepEP call sequences, with vLLM's keyword names
and values (deepep_ht_prepare_finalize, deepep_ll_prepare_finalize, the all2all manager's buffers),
through ``import deep_ep`` (the opt-in package in compat/deep_ep) on vLLM's gloo group."""
from __future__ import annotations

import torch
import torch.distributed as dist

import engine_formats
from engine_cases import _close, _deep_ep, _device
from epcomm.testing import reference_combine, reference_dispatch, reference_low_latency_combine
from epcomm.testing.sweeps import _to_cpu, expert_fn, make_routing, rank_fn, world


def high_throughput(form: str, hidden: int = 256):
    """deepep_ht_prepare_finalize: the all2all manager's Buffer (1 GiB of NVLink bytes,
    ``num_qps_per_rank=1``, explicit destroy), ``get_dispatch_layout`` and ``dispatch`` with every
    keyword vLLM passes (``x=(a1q, a1q_scale)`` in vLLM's quantisation ``form``,
    ``expert_alignment=1``, ``num_worst_tokens``, the tuned configs), the experts on the received
    FP8 rows, ``combine(x=..., handle=..., topk_weights=None, ...)``, ``destroy``. Returns the
    received scale dtype and width."""
    deep_ep = _deep_ep()
    R, rank = world()
    dev = _device()
    cpu_group = dist.new_group(list(range(R)), backend="gloo")
    buffer = deep_ep.Buffer(group=cpu_group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=0,
                            low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    num_experts = 4 * R
    got = None
    for step, worst in enumerate((0, 12 * R)):
        xs, topks, weights = make_routing(700 + step, "uniform", R, num_experts, 4, 12, hidden, fixed_tokens=12)
        sent = [xs[i] if form == "bf16" else engine_formats.quantize(xs[i].to(dev), form) for i in range(R)]
        num_tokens_per_rank, num_tokens_per_rdma_rank, expert_num_tokens, is_token_in_rank, event = \
            buffer.get_dispatch_layout(topk_idx=topks[rank].to(dev), num_experts=num_experts, previous_event=None,
                                       async_finish=False, allocate_on_comm_stream=False)
        token_data, expert_topk_ids, expert_topk_weights, per_expert_list, handle, event = buffer.dispatch(
            x=sent[rank], handle=None, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=expert_num_tokens, topk_idx=topks[rank].to(dev),
            topk_weights=weights[rank].to(dev), expert_alignment=1, num_worst_tokens=worst,
            config=deep_ep.Buffer.get_dispatch_config(R), previous_event=None, async_finish=False,
            allocate_on_comm_stream=False)
        want = reference_dispatch([_to_cpu(s) for s in sent], topks, weights, num_experts)[rank]
        received = want["recv_src_idx"].shape[0]
        if form == "bf16":
            rows = token_data
            assert torch.equal(rows.cpu()[:received], want["recv_x"])
        else:
            engine_formats.check_fp8_received(token_data, want["recv_x"], form, received)
            got = (token_data[1].dtype, token_data[1].shape[1])
            rows = engine_formats.cast_back(*token_data, form).to(torch.bfloat16)
        assert torch.equal(expert_topk_ids.cpu()[:received], want["recv_topk_idx"])
        assert per_expert_list == ([] if worst else want["num_recv_tokens_per_expert_list"])
        combined_x, _, event = buffer.combine(x=rank_fn(rank, rows), handle=handle, topk_weights=None,
                                              config=deep_ep.Buffer.get_combine_config(R), previous_event=None,
                                              async_finish=False, allocate_on_comm_stream=False)
        home = xs[rank] if form == "bf16" else engine_formats.cast_back(*_to_cpu(sent[rank]), form).to(torch.bfloat16)
        _close(combined_x, reference_combine(home, topks[rank], num_experts, R, rank_fn), f"{form} combine")
    buffer.destroy()
    dist.destroy_process_group(cpu_group)
    return got


def low_latency(hidden: int = 512, max_tokens: int = 8):
    """deepep_ll_prepare_finalize and the elastic-EP mask calls: a Buffer sized by the hint,
    ``num_qps_per_rank`` = local experts, ``enable_shrink``; NVFP4 dispatch
    (``VLLM_DEEPEPLL_NVFP4_DISPATCH=1``: ``use_fp8=False, use_nvfp4=True, x_global_scale=a1_gscale``,
    checked against the reference quantizer) and FP8 dispatch (``round_scale``/``use_ue8m0``), each
    with the receive hook; combine with ``zero_copy=False``, the hook and ``out=``; then a rank masked
    and unmasked, the mask cleaned, ``clean_low_latency_buffer``, ``destroy``."""
    deep_ep = _deep_ep()
    R, rank = world()
    dev = _device()
    cpu_group = dist.new_group(list(range(R)), backend="gloo")
    num_experts, M = 4 * R, max_tokens
    buffer = deep_ep.Buffer(cpu_group, num_nvl_bytes=0,
                            num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts),
                            low_latency_mode=True, num_qps_per_rank=num_experts // R,
                            allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, enable_shrink=True,
                            explicitly_destroy=True)
    for step, mode in enumerate(("nvfp4", "fp8_ue8m0", "nvfp4")):
        xs, topks, weights = make_routing(800 + step, "holes", R, num_experts, 3, M, hidden, fixed_tokens=M - step)
        a1, topk_ids, topk_weights = xs[rank].to(dev), topks[rank].to(dev), weights[rank].to(dev)
        a1_gscale = torch.full((1,), 448 * 6 / max(float(x.float().abs().max()) for x in xs), device=dev)
        if mode == "nvfp4":
            expert_x, expert_num_tokens, handle, _, hook = buffer.low_latency_dispatch(
                a1, topk_ids, M, num_experts, use_fp8=False, **dict(use_nvfp4=True),
                **dict(x_global_scale=a1_gscale), async_finish=False, return_recv_hook=True)
            hook()
            engine_formats.check_nvfp4_received(expert_x, expert_num_tokens, handle, xs, topks, a1_gscale, rank)
            fused_expert_output = engine_formats.nvfp4_expert_outputs(expert_x, a1_gscale, rank, expert_fn)
            seen = engine_formats.nvfp4_expert_view(xs[rank], a1_gscale)
            want = reference_low_latency_combine(seen.to(torch.bfloat16), topks[rank], weights[rank], expert_fn, False)
            # (the reference rounds the seen token to bf16 once more: within the tolerance)
        else:
            expert_x, expert_num_tokens, handle, _, hook = buffer.low_latency_dispatch(
                a1, topk_ids, M, num_experts, use_fp8=True, round_scale=True, use_ue8m0=True, async_finish=False,
                return_recv_hook=True)
            hook()
            assert expert_x[1].dtype == torch.int32 and expert_x[1].shape[2] == hidden // 512
            rows = torch.stack([engine_formats.cast_back(expert_x[0][e], expert_x[1][e], "sglang_blackwell")
                                for e in range(num_experts // R)])
            local = rank * (num_experts // R) + torch.arange(num_experts // R, device=rows.device)
            fused_expert_output = (rows * ((local.float() + 1) / 8)[:, None, None]).to(torch.bfloat16)
            want = reference_low_latency_combine(xs[rank], topks[rank], weights[rank], expert_fn, True, True)
        assert len(handle) == 5 and handle[3] == hidden
        output = torch.empty(a1.shape, dtype=torch.bfloat16, device=dev)
        _, event, hook = buffer.low_latency_combine(fused_expert_output, topk_ids, topk_weights, handle,
                                                   async_finish=False, zero_copy=False, return_recv_hook=True,
                                                   out=output)
        hook()
        _close(output, want, f"low-latency {mode} round trip")
    # the elastic-EP calls: mask the last rank, see it, unmask, clean
    status = torch.zeros(R, dtype=torch.int32, device=dev)
    buffer.low_latency_update_mask_buffer(R - 1, True)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * (R - 1) + [1]
    buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(status)
    assert status.sum().item() == 0
    buffer.clean_low_latency_buffer(M, hidden, num_experts)
    buffer.destroy()
    dist.destroy_process_group(cpu_group)
    return True
