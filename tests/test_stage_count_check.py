"""The stage's per-expert count check (stage.py: ``_expert_entries``, ``_check_expert_counts``;
the list programs run it, in their token loop), run by Triton's interpreter on the
CPU (tests/expert_count_cases.py): each destination's local experts counted from topk_idx as the
layout kernel counts them (entries of -1 count for no one), and a caller's num_tokens_per_expert off
by one at any expert sets COUNT_ERROR to ABORT_NUM_TOKENS_PER_EXPERT. Skipped without Triton."""
import json

import pytest
import torch

pytest.importorskip("triton")

from interpreted import run_cases  # noqa: E402

from epcomm.backends.gpu import agreement  # noqa: E402


def test_the_count_check_counts_each_destinations_experts_and_catches_a_wrong_count():
    lines = [json.loads(line) for line in run_cases("expert_count_cases.py").splitlines()]
    assert len(lines) == 3
    for line in lines:
        case, ids = line["case"], torch.tensor(line["ids"])
        num_local = case["experts"] // case["ranks"]
        want = torch.bincount(ids[ids >= 0], minlength=case["experts"]).view(case["ranks"], num_local)
        assert line["counts"] == want.tolist(), case
        assert line["error"] == (agreement.ABORT_NUM_TOKENS_PER_EXPERT if "skew" in case else 0), case
