"""SGLang unchanged on ``import deep_ep`` (compat/deep_ep): its DeepEP dispatcher's call sequence with
its keyword names and values — the ``--deepep-config`` JSON, ``expert_alignment=128``, its FP8 scale
formats, NVFP4 and FP8 low-latency dispatch on one Buffer — on 4 CPU ranks (sglang_cases.py)."""
import json

import pytest
import torch

import sglang_cases


@pytest.mark.parametrize("form, scales", [
    ("sglang_blackwell", (torch.int32, 2)),               # DeepGEMM on Blackwell: UE8M0 int32 [T, H/512], TMA-aligned
    ("sglang_hopper", (torch.float32, 8)),                # float32 [T, H/128], row-major
    ("sglang_hopper_column_major", (torch.float32, 8)),   # float32 [T, H/128], column-major TMA-aligned
    ("bf16", None),                                       # SGLANG_DEEPEP_BF16_DISPATCH
])
def test_sglang_dispatchers_with_its_scale_formats(pools, form, scales):
    """The received scales come back in the sent dtype and width, row-major, bit for bit; the
    low-latency dispatcher's NVFP4 and FP8 round trips between the normal ones."""
    assert pools.get(4).run(sglang_cases.dispatchers, form) == [scales] * 4


@pytest.mark.parametrize("return_recv_hook", [False, True])
def test_sglang_deepep_config_file_and_receive_hook(pools, tmp_path, return_recv_hook):
    """``--deepep-config`` given as a file path; the low-latency dispatcher with and without the hook."""
    path = tmp_path / "deepep_config.json"
    path.write_text(json.dumps(sglang_cases.DEEPEP_CONFIG, indent=2))
    assert pools.get(4).run(sglang_cases.dispatchers, "sglang_blackwell", str(path), 512, False,
                            return_recv_hook) == [(torch.int32, 1)] * 4
