"""Randomized fuzz of valid inputs on the reference backend (failure contract): >= 1000 normal-mode
and >= 1000 low-latency cases against the single-process reference, including empty ranks, -1
holes, skewed and one-rank routings, a token listing an expert twice, zero tokens, NaN/inf rows.
Fresh seeds (not the other sweeps'), on 2 and 3 CPU ranks."""
import pytest

import ep_cases

NORMAL = {2: 700, 3: 350}
LOW_LATENCY = {2: 700, 3: 350}


@pytest.mark.parametrize("world_size", [2, 3])
def test_fuzz_normal_mode(pools, world_size):
    cases = NORMAL[world_size]
    checked = pools.get(world_size).run(ep_cases.normal_mode_sweep, cases, 20_000 + 1000 * world_size, 128, 4, 24,
                                        True, timeout_s=600)
    assert checked == [cases] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_fuzz_low_latency(pools, world_size):
    cases = LOW_LATENCY[world_size]
    checked = pools.get(world_size).run(ep_cases.low_latency_sweep, cases, 30_000 + 1000 * world_size, 512, 4, 16,
                                        "cpu", 0, True, timeout_s=600)
    assert checked == [cases] * world_size
