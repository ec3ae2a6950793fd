"""The low-latency combine's receive reduce (a token's entries summed one row at a time) — the
kernel's own device function, run by Triton's interpreter on the CPU (tests/ll_reduce_cases.py).
Skipped where Triton is not installed."""
import json

import pytest
import torch

pytest.importorskip("triton")

from interpreted import run_cases  # noqa: E402


@pytest.fixture(scope="module")
def cases():
    return [json.loads(line) for line in run_cases("ll_reduce_cases.py").splitlines()]


def _bf16(bits):
    return torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16).float()


def test_the_reduce_sums_the_weighted_rows_and_marks_lost_tokens(cases):
    """Lanes past K and entries with no expert add nothing, and their slots (stale: NaN here) are
    not read; a masked rank's entries are skipped with shrink and make the token's row NaN without
    it; a rank gone (another call, another
    fingerprint) makes its tokens' rows NaN; column blocks cover the row."""
    for case in cases:
        got, want = _bf16(case["results"]["kernel"]), _bf16(case["results"]["reference"])
        assert torch.equal(got.isnan(), want.isnan()), case["case"]
        assert bool(want.isnan().any()) == bool(case["case"].get("gone") or
                                                (case["case"].get("masked") and not case["case"].get("shrink")))
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=8e-3, atol=1e-2,
                                   msg=lambda m: f"{case['case']}: {m}")
