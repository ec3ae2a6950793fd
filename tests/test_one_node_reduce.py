"""The one-node combine's per-token reduce in both forms (the [R, BLOCK_C] tile, and RANK_LOOP's rank
by rank sum, NormalMode.rank_loop_reduce) — the kernels' own device function, run by Triton's
interpreter on the CPU (tests/reduce_token_cases.py). Skipped where Triton is not installed."""
import json

import pytest
import torch

pytest.importorskip("triton")

from interpreted import run_cases  # noqa: E402

@pytest.fixture(scope="module")
def cases():
    return [json.loads(line) for line in run_cases("reduce_token_cases.py").splitlines()]


def _floats(bits, dtype):
    return torch.tensor(bits, dtype=torch.int16 if dtype == torch.bfloat16 else torch.int32).view(dtype).float()


@pytest.mark.parametrize("rank_loop", ["False", "True"], ids=["tile", "rank loop"])
def test_each_form_sums_the_present_ranks_rows_and_the_bias(cases, rank_loop):
    """Masked lanes (ranks past the group, ranks a token is not on) add nothing, column blocks
    cover the row, a token on no rank gets its bias alone; the float32 sums round to bf16 once
    (the forms may differ from the reference by float32 order: a bf16 step at most)."""
    for case in cases:
        got, want = case["results"][rank_loop], case["results"]["reference"]
        torch.testing.assert_close(_floats(got["out"], torch.bfloat16), _floats(want["out"], torch.bfloat16),
                                   rtol=8e-3, atol=1e-2, msg=lambda m: f"{case['case']}: {m}")
        torch.testing.assert_close(_floats(got["out_w"], torch.float32), _floats(want["out_w"], torch.float32),
                                   msg=lambda m: f"{case['case']} weights: {m}")


def test_the_rank_loop_sums_in_rank_order(cases):
    """RANK_LOOP adds the ranks' rows in rank order: with two ranks it equals the tile's sum bit for
    bit (one addition, no order to differ in)."""
    two = next(case for case in cases if case["case"]["ranks"] == 2)
    assert two["results"]["True"] == two["results"]["False"]
