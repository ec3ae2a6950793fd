"""Normal mode on the torch_dist backend (CPU, gloo) against the single-process reference."""
import pytest

import ep_cases

# Randomized routings per world size (hundreds in total across the suite).
CASES = {1: 40, 2: 90, 4: 60, 8: 30}


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_randomized_dispatch_combine(pools, world_size):
    checked = pools.get(world_size).run(ep_cases.normal_mode_sweep, CASES[world_size], 100 * world_size)
    assert checked == [CASES[world_size]] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_worst_tokens_and_call_options(pools, world_size):
    assert all(pools.get(world_size).run(ep_cases.worst_tokens_and_options))


@pytest.mark.parametrize("world_size", [2, 8])
def test_repeated_calls_no_stale_state(pools, world_size):
    assert pools.get(world_size).run(ep_cases.repeated_calls) == [30] * world_size


def test_larger_hidden_and_topk(pools):
    assert pools.get(4).run(ep_cases.normal_mode_sweep, 6, 9000, 2048, 8, 64) == [6] * 4
