"""Low-latency mode on the torch_dist backend (CPU, gloo) against the single-process reference."""
import pytest

import ep_cases

CASES = {1: 24, 2: 48, 4: 32, 8: 16}


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_randomized_low_latency(pools, world_size):
    assert pools.get(world_size).run(ep_cases.low_latency_sweep, CASES[world_size], 50 * world_size) == \
        [CASES[world_size]] * world_size


def test_two_results_held_at_once(pools):
    assert all(pools.get(2).run(ep_cases.low_latency_two_results_held))


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_masking(pools, world_size):
    assert all(pools.get(world_size).run(ep_cases.low_latency_masking))


def test_clean_low_latency_buffer(pools):
    assert all(pools.get(2).run(ep_cases.low_latency_clean_buffer))


def test_duplicate_experts_get_their_own_weights(pools):
    assert all(pools.get(2).run(ep_cases.low_latency_duplicate_experts))
