"""Argument checks kept per shape (checks.ShapeCache in Buffer.dispatch and get_dispatch_layout): a
bad argument is still rejected after a valid call of the same shapes, naming the argument."""
import pytest
import torch

import shape_cache_cases
from epcomm import checks


@pytest.mark.parametrize("rule", sorted(shape_cache_cases.RULES))
def test_rejected_after_a_valid_call(pools, rule):
    expected, _ = shape_cache_cases.RULES[rule]
    assert pools.get(2).run(shape_cache_cases.rejected_after_valid_calls, rule) == [expected, expected]


def test_a_checked_plain_fp8_pair_goes_to_the_backend_without_a_payload(pools):
    """(fp8.plain_pair) float32 scales [T, H/128], in any strides or as a list, need no payload once
    their shapes passed; the first call of a key and int32 scales (a view as float32) get one. The
    rows and scales received are the same bits every time, in the caller's dtype."""
    made, same, dtypes = pools.get(2).run(shape_cache_cases.fp8_pairs_after_a_checked_call)[0]
    # (full, cached) per form: the first of each key makes one, then the float32 forms none
    assert made == [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert same and dtypes == ["torch.float32", "torch.int32"]


@pytest.mark.parametrize("rule", sorted(shape_cache_cases.LL_RULES))
def test_low_latency_rejected_after_a_valid_call(pools, rule):
    expected, _ = shape_cache_cases.LL_RULES[rule]
    assert pools.get(2).run(shape_cache_cases.ll_rejected_after_valid_calls, rule) == [expected, expected]


def test_low_latency_keys_tell_apart_what_the_checks_read():
    x, topk = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64)
    base = checks.low_latency_dispatch_key(x, topk, 8, 8, (True, False, False, False), (None, None))
    assert base == checks.low_latency_dispatch_key(x.clone(), topk.clone(), 8, 8, (True, False, False, False),
                                                   (None, None))
    others = [checks.low_latency_dispatch_key(x[:3], topk[:3], 8, 8, (True, False, False, False), (None, None)),
              checks.low_latency_dispatch_key(x, topk, 8.0, 8, (True, False, False, False), (None, None)),
              checks.low_latency_dispatch_key(x, topk, 8, 16, (True, False, False, False), (None, None)),
              checks.low_latency_dispatch_key(x, topk, 8, 8, (True, True, True, False), (None, None)),
              checks.low_latency_dispatch_key(x, topk, 8, 8, (True, False, False, False),
                                              (torch.zeros(4, dtype=torch.int32), None))]
    assert all(other is not None and other != base for other in others)
    assert checks.low_latency_dispatch_key(x, [[0, 1]], 8, 8, (True, False, False, False), (None, None)) is None


def _key(**override):
    x, per_rank, in_rank = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), \
        torch.zeros(4, 2, dtype=torch.bool)
    args = dict(cached=False, x=x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=None,
                is_token_in_rank=in_rank, num_tokens_per_expert=torch.zeros(8, dtype=torch.int32),
                topk_idx=torch.zeros(4, 2, dtype=torch.int64), topk_weights=torch.zeros(4, 2),
                expert_alignment=1, num_worst_tokens=0)
    args.update(override)
    return checks.dispatch_key(**args)


def test_dispatch_key_tells_apart_what_the_checks_read():
    base = _key()
    assert base == _key() and hash(base) == hash(_key())
    others = [_key(cached=True), _key(x=torch.zeros(4, 8, dtype=torch.float16)), _key(x=torch.zeros(5, 8, dtype=torch.bfloat16)),
              _key(x=torch.zeros(8, 4, dtype=torch.bfloat16).t()), _key(x=torch.zeros(4, 8, dtype=torch.bfloat16, device="meta")),
              _key(x=torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16), requires_grad=False)),
              _key(topk_idx=None, topk_weights=None), _key(num_tokens_per_rdma_rank=torch.zeros(1, dtype=torch.int32)),
              _key(expert_alignment=True), _key(expert_alignment=2), _key(num_worst_tokens=0.0)]
    assert all(other is not None and other != base for other in others)
    # the weights where the ids were (and none there) is another key, not a shifted copy of one
    assert _key(topk_idx=None) != _key(topk_weights=None)


def test_dispatch_key_of_arguments_without_metadata_is_none():
    assert _key(num_tokens_per_rank=[1, 2]) is None and _key(x=3) is None
    assert checks.layout_key([[0, 1]], 8) is None


def test_shape_cache_is_bounded_and_takes_no_none():
    cache = checks.ShapeCache()
    cache.remember(None)
    assert len(cache) == 0
    for i in range(checks.SHAPE_CACHE_SIZE + 5):
        cache.remember(("key", i))
    assert 0 < len(cache) <= checks.SHAPE_CACHE_SIZE and ("key", checks.SHAPE_CACHE_SIZE + 4) in cache
    cache.remember(("unhashable", []))  # (never a key of a valid call: ignored)
    with pytest.raises(TypeError):
        ("unhashable", []) in cache


def test_fp8_pair_key_tells_apart_what_the_pair_checks_read():
    values, scales = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.zeros(4, 2)
    base = checks.fp8_pair_key((values, scales))
    assert base == checks.fp8_pair_key([values.clone(), scales.clone()])
    others = [checks.fp8_pair_key((values, scales.half())), checks.fp8_pair_key((values, scales[:3])),
              checks.fp8_pair_key((values.view(torch.uint8), scales)), checks.fp8_pair_key((values[:, :128], scales))]
    assert all(other is not None and other != base for other in others)
    # the scales' strides are not checked (any layout is accepted): the same key
    assert checks.fp8_pair_key((values, scales.t().contiguous().t())) == base
    assert checks.fp8_pair_key((values, scales, scales)) is None and checks.fp8_pair_key(values) is None
