"""vLLM unchanged on ``import deep_ep`` (compat/deep_ep): its high-throughput and low-latency
prepare/finalize call sequences, with vLLM's keyword names and values, on 4 CPU ranks (vllm_cases.py)."""
import pytest
import torch

import vllm_cases


@pytest.mark.parametrize("form, scales", [
    ("bf16", None),
    ("vllm_block", (torch.float32, 2)),       # 128-block FP8: float32 [T, H/128]
    ("vllm_per_token", (torch.float32, 1)),   # per-token FP8: float32 [T, 1]
    ("vllm_mxfp8", (torch.int32, 2)),         # MXFP8: int32 [T, H/128], UE8M0 bytes of 32-value blocks
])
def test_vllm_high_throughput_dispatch_carries_its_scale_formats(pools, form, scales):
    """Each format's received scales come back in its dtype and width, row-major, bit for bit."""
    assert pools.get(4).run(vllm_cases.high_throughput, form) == [scales] * 4


def test_vllm_low_latency_nvfp4_and_fp8_dispatch_with_hooks_and_mask_calls(pools):
    assert pools.get(4).run(vllm_cases.low_latency) == [True] * 4
