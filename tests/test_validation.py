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


def test_timeout_message_names_the_ranks_once():
    from epcomm import EPTimeoutError
    said = EPTimeoutError("rank 0: combine waited 3 s for ranks [1], which did not make the call", [1])
    assert str(said).count("[1]") == 1 and said.peers == [1]
    added = EPTimeoutError("rank 0: a wait for peers exceeded 3 s", [2, 1])
    assert str(added).endswith("(waited for ranks [1, 2])") and added.peers == [1, 2]
