"""Megatron-Core unchanged on ``import deep_ep`` (compat/deep_ep): its fused all-to-all
(fused_a2a.py) forward and backward over two training steps, on 4 CPU ranks (megatron_cases.py)."""
import pytest

import megatron_cases


@pytest.mark.parametrize("async_finish", [False, True])
def test_megatron_fused_all_to_all_trains_like_the_dense_layer(pools, async_finish):
    assert pools.get(4).run(megatron_cases.fused_layer, async_finish) == [True] * 4
