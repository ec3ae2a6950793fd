"""One test per input-validation rule: EPInputError names the argument, and the buffer stays usable."""
import pytest

import ep_cases


@pytest.mark.parametrize("rule", sorted(ep_cases.VALIDATION_RULES))
def test_rule(pools, rule):
    expected, _ = ep_cases.VALIDATION_RULES[rule]
    assert pools.get(2).run(ep_cases.validation_case, rule) == [expected, expected]


def test_state_errors(pools):
    assert all(pools.get(2).run(ep_cases.state_errors))


def test_worst_tokens_overflow_raises(pools):
    assert all(pools.get(2).run(ep_cases.worst_tokens_overflow))
