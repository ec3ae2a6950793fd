"""epcomm as a drop-in for deep_ep: the calls serving engines make, and backend choice."""
import ep_cases


def test_deep_ep_dropin(pools):
    """vLLM's and SGLang's deep_ep.Buffer calls run unchanged on epcomm.compat.deep_ep."""
    assert pools.get(2).run(ep_cases.deep_ep_dropin) == [True, True]


def test_backend_argument_and_override(pools):
    assert pools.get(2).run(ep_cases.backend_argument) == [True, True]
