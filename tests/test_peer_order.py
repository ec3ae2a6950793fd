"""Every rank starts on a different peer (DESIGN's scale rule) in the low-latency kernels and the
two-level mode's hops: the index maps that replaced their rank-order walks — where every rank took
peer 0 (or node 0, or forwarder 0) first, so that all of them loaded one GPU's links at once —
are bijections, so every item is still taken exactly once and the results do not change. The
kernels' own device functions, run by Triton's interpreter on the CPU (tests/peer_order_cases.py).
Skipped where Triton is not installed."""
import json
from collections import Counter

import pytest

pytest.importorskip("triton")

from interpreted import run_cases  # noqa: E402

@pytest.fixture(scope="module")
def orders():
    return json.loads(run_cases("peer_order_cases.py"))


def test_peer_after_starts_each_rank_on_the_next_and_keeps_the_ranks_on_different_peers(orders):
    """gpu/walk.py's walk (the low-latency kernels', the two-level hops'): rank r's walk is r + 1, r + 2,
    ... (mod n), each peer once per n steps, and at every step the n ranks are on n different peers."""
    for entry in orders["walks"]:
        n, steps = entry["case"]["n"], entry["case"]["steps"]
        walks = entry["walks"]
        for me, walk in enumerate(walks):
            assert walk == [(me + 1 + i) % n for i in range(steps)], entry["case"]
            assert sorted(walk[:n]) == list(range(n)), entry["case"]
        for i in range(steps):
            assert sorted(walk[i] for walk in walks) == list(range(n)), (entry["case"], i)


def test_low_latency_combine_pushes_to_the_same_homes_as_before(orders):
    """ep_ll_combine's send items (local expert l, home peer_after(item, rank, R)): the rotation
    it had inline, (item + rank + 1) % R, over items of several experts (item = l * R + i)."""
    entry = next(e for e in orders["walks"] if e["case"] == dict(n=8, steps=24))
    for rank, walk in enumerate(entry["walks"]):
        assert walk == [(item + rank + 1) % 8 for item in range(24)]


def test_low_latency_count_release_starts_on_the_next_ranks_experts(orders):
    """_publish_counts' walk over the experts (expert_after): every expert once, the experts of the
    rank after this one first, each rank's in ascending order; at every place the ranks' last
    arrivers release to different ranks (a rank-order walk had them all on rank 0 first)."""
    for entry in orders["experts"]:
        num_local, num_ranks = entry["case"]["num_local"], entry["case"]["num_ranks"]
        E = num_local * num_ranks
        walks = entry["experts"]
        for rank, walk in enumerate(walks):
            assert sorted(walk) == list(range(E)), entry["case"]
            assert walk == [((rank + 1) * num_local + w) % E for w in range(E)], entry["case"]
        for place in range(E):
            assert len({walk[place] // num_local for walk in walks}) == num_ranks, (entry["case"], place)


def test_two_level_hop2_node_ranks_start_on_different_forwarders(orders):
    """ml_dispatch_forward's loads and ml_combine_push's stores (hop2_program): at every program x
    the k ranks of a node work on k different forwarders of it, rank j's first on forwarder j + 1,
    its own area last; the sources' nodes keep their order (m = x // k)."""
    for entry in orders["hop2"]:
        R, k, C = entry["case"]["num_ranks"], entry["case"]["ranks_per_node"], entry["case"]["channels"]
        programs = entry["programs"]
        for rank in range(R):
            node, j = divmod(rank, k)
            first = programs[rank][0]
            assert first[0] % k == (j + 1) % k, (entry["case"], rank)
            for x in range(R):
                assert programs[rank][x][3] == x // k, (entry["case"], rank, x)
        for node in range(R // k):
            for row in range(R * C):
                forwarders = [programs[node * k + j][row][0] % k for j in range(k)]
                assert sorted(forwarders) == list(range(k)), (entry["case"], node, row)


def test_two_level_hop2_takes_every_source_and_channel_once(orders):
    """Each rank's R x C programs take every (source, channel) exactly once, with d's local index j,
    s's node m and the NVLink base of s's forwarder on d's node (bases here: 1000 * (rank + 1))."""
    for entry in orders["hop2"]:
        R, k, C = entry["case"]["num_ranks"], entry["case"]["ranks_per_node"], entry["case"]["channels"]
        for rank, programs in enumerate(entry["programs"]):
            node, j = divmod(rank, k)
            taken = Counter((s, c) for s, c, *_ in programs)
            assert sorted(taken) == [(s, c) for s in range(R) for c in range(C)], (entry["case"], rank)
            assert set(taken.values()) == {1}, (entry["case"], rank)
            for row, (s, c, jj, m, base) in enumerate(programs):
                assert c == row // R and jj == j and m == s // k, (entry["case"], rank, row)
                assert base == 1000 * (node * k + s % k + 1), (entry["case"], rank, row)
