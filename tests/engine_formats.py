"""The payload formats engines hand to DeepEP, written here from the engines' own code (rank bodies in
vllm_cases.py, sglang_cases.py), and the checks of what comes back: FP8 scale formats of normal
dispatch, NVFP4 low-latency dispatch checked against epcomm's reference quantizer."""
from __future__ import annotations

import torch

from epcomm import fp8, nvfp4


def _tma_aligned_column_major(words: torch.Tensor) -> torch.Tensor:
    """``[T, S]`` laid out column-major with the token dimension padded to a multiple of 4 (strides
    ``(1, round_up(T, 4))``): DeepGEMM's TMA-aligned scale layout, as SGLang allocates it."""
    T, S = words.shape
    storage = torch.zeros(S, (T + 3) // 4 * 4, dtype=words.dtype, device=words.device)
    storage[:, :T] = words.t()
    return storage.t()[:T]


def quantize(x: torch.Tensor, form: str):
    """``x`` bf16 ``[T, H]`` cast to an engine's FP8 format, ``(values e4m3 [T, H], scales)``:

    - ``sglang_blackwell``: SGLang's ``sglang_per_token_group_quant_fp8(x, 128, column_major_scales=True,
      scale_tma_aligned=True, scale_ue8m0=True)`` on Blackwell with DeepGEMM: power-of-two scales as
      UE8M0 bytes, four per int32, ``[T, H/512]``, column-major and TMA-aligned;
    - ``sglang_hopper``: the same without UE8M0: float32 ``[T, H/128]``, row-major;
    - ``sglang_hopper_column_major``: float32 ``[T, H/128]``, column-major and TMA-aligned;
    - ``vllm_block``: vLLM's 128-block quantisation, float32 ``[T, H/128]``, row-major;
    - ``vllm_per_token``: vLLM's per-token quantisation, float32 ``[T, 1]``;
    - ``vllm_mxfp8``: vLLM's MXFP8 path: int32 ``[T, H/128]`` (UE8M0 bytes of 32-value blocks, four per word).
    """
    T, H = x.shape
    if form == "vllm_per_token":
        amax = x.float().abs().amax(1, keepdim=True).clamp_min(1e-4)
        scales = amax / fp8.FP8_MAX
        return (x.float() / scales).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE), scales
    if form == "vllm_mxfp8":
        blocks = x.float().view(T, H // 32, 32)
        scales = fp8.round_up_to_power_of_two(blocks.abs().amax(-1).clamp_min(1e-4) / fp8.FP8_MAX)
        values = (blocks / scales.unsqueeze(-1)).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE).view(T, H)
        return values, fp8.pack_ue8m0(scales)
    values, scales = fp8.per_token_cast_to_fp8(x, round_scale=form == "sglang_blackwell")
    if form == "sglang_blackwell":
        return values, _tma_aligned_column_major(fp8.pack_ue8m0(scales))
    if form == "sglang_hopper_column_major":
        return values, _tma_aligned_column_major(scales)
    return values, scales


def cast_back(values: torch.Tensor, scales: torch.Tensor, form: str) -> torch.Tensor:
    """The received FP8 pair of format ``form`` back to float32 (what an expert computes on)."""
    if form == "vllm_per_token":
        return values.float() * scales.float()
    if form == "vllm_mxfp8":
        T, H = values.shape
        return (values.float().view(T, H // 32, 32) * fp8.unpack_ue8m0(scales).unsqueeze(-1)).view(T, H)
    return fp8.per_token_cast_back(values, scales, torch.float32)


def check_fp8_received(recv_x, want_x, form: str, received: int) -> None:
    """What DeepEP returns: the values' bits, and the scales in the sent dtype and width, row-major,
    with the bits of the sender's rows."""
    values, scales = recv_x
    want_values, want_scales = want_x
    assert torch.equal(values.cpu()[:received].view(torch.uint8), want_values.view(torch.uint8)), form
    assert scales.dtype == want_scales.dtype and scales.shape[1] == want_scales.shape[1], (form, scales.shape)
    assert scales.is_contiguous(), f"{form}: received scales must be row-major"
    assert torch.equal(scales.cpu()[:received].view(torch.int32), want_scales.view(torch.int32)), form


def check_nvfp4_received(recv_x, recv_count, handle, xs, topks, global_scale, rank: int) -> None:
    """Every valid row of an NVFP4 low-latency dispatch holds exactly the reference quantizer's
    bytes of its source token: values ``uint8 [R*M, H/2, E_local]``, block scales
    ``float8_e4m3fn [32, 4, rm, 4, rk, E_local]`` (DeepEP's layout)."""
    values, scales = recv_x
    R = len(xs)
    num_local = values.shape[2]
    hidden = values.shape[1] * 2
    assert values.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
    assert values.shape[0] == handle.num_max_dispatch_tokens_per_rank * R
    assert scales.shape == (32, 4, -(-values.shape[0] // 128), 4, -(-hidden // 64), num_local)
    linear = nvfp4.unswizzle_scales(scales.cpu(), values.shape[0], hidden // 16)  # [E_local, R*M, H/16]
    references = [nvfp4.quantize(x.cpu(), global_scale.cpu()) for x in xs]
    layout = handle.recv_layout_range.cpu()
    for e in range(num_local):
        seen = 0
        for src in range(R):
            begin, count = int(layout[e, src] >> 32), int(layout[e, src] & 0xFFFFFFFF)
            for row in range(begin, begin + count):
                token = int(handle.recv_src_info[e, row])
                packed, block_scales = references[src]
                assert torch.equal(values[row, :, e].cpu(), packed[token]), (e, src, row)
                assert torch.equal(linear[e, row].view(torch.uint8), block_scales[token].view(torch.uint8)), (e, row)
            seen += count
        assert seen == int(recv_count[e])
        want = sum(int((topks[src] == rank * num_local + e).sum()) for src in range(R))
        assert seen == want, (e, seen, want)


def nvfp4_expert_view(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """A token as an expert sees it after an NVFP4 dispatch (float32)."""
    return nvfp4.dequantize(*nvfp4.quantize(x.cpu(), global_scale.cpu()), global_scale.cpu())


def nvfp4_expert_outputs(recv_x, global_scale: torch.Tensor, rank: int, expert_fn) -> torch.Tensor:
    """bf16 ``[E_local, R*M, H]`` expert outputs from a received NVFP4 payload: every row
    dequantized and run through ``expert_fn`` (garbage rows past the counts too, as an engine's
    masked GEMM does; combine ignores them)."""
    values, scales = recv_x
    rows, half, num_local = values.shape
    linear = nvfp4.unswizzle_scales(scales, rows, half * 2 // 16)
    out = []
    for e in range(num_local):
        seen = nvfp4.dequantize(values[:, :, e], linear[e], global_scale)
        experts = torch.full((rows,), rank * num_local + e, dtype=torch.int64, device=seen.device)
        out.append(expert_fn(experts, torch.nan_to_num(seen)).to(torch.bfloat16))
    return torch.stack(out)
