"""The one-node pull and push schedule (gpu/normal/one_node/schedule.py): every row taken once, and
every peer served at once — the kernels' own device functions, run by Triton's interpreter on the
CPU (tests/schedule_cases.py). Skipped where Triton is not installed."""
import json
from collections import Counter

import pytest

pytest.importorskip("triton")

from interpreted import run_cases  # noqa: E402

@pytest.fixture(scope="module")
def walks():
    return [json.loads(line) for line in run_cases("schedule_cases.py").splitlines()]


def _rows_taken(case, items):
    counts = case["rows_per_source"]
    num_rows = case.get("num_rows", sum(counts))
    taken = Counter()
    for program in items:
        for source, first, end in program:
            start = sum(counts[:source])
            assert start <= first < end <= min(start + counts[source], num_rows), (source, first, end)
            assert end - first <= case["block_r"]
            taken.update(range(first, end))
    return taken, num_rows


def test_every_received_row_is_taken_exactly_once_in_either_order(walks):
    for walk in walks:
        taken, num_rows = _rows_taken(walk["case"], walk["items"])
        assert sorted(taken) == list(range(num_rows)), walk["case"]
        assert set(taken.values()) <= {1}, walk["case"]


def _rotation(case):
    """schedule.py's rule in Python: item v of round j is block j of the (v - S(j))-th source with
    more than j blocks, counting from (rank + 1 + j) mod R; program p takes items p, p + P, ..."""
    counts, rank, block_r = case["rows_per_source"], case["rank"], case["block_r"]
    num_rows = case.get("num_rows", sum(counts))
    R = len(counts)
    starts = [min(sum(counts[:s]), num_rows) for s in range(R)]
    ends = [min(sum(counts[:s + 1]), num_rows) for s in range(R)]
    blocks = [(e - b + block_r - 1) // block_r for b, e in zip(starts, ends)]
    items = []
    for j in range(max(blocks, default=0)):
        for step in range(R):
            s = (rank + 1 + j + step) % R
            if blocks[s] > j:
                first = starts[s] + j * block_r
                items.append((s, first, min(first + block_r, ends[s])))
    return [items[p::case["programs"]] for p in range(case["programs"])]


def test_every_peer_items_follow_the_rotation_rule(walks):
    """The kernels' item_block (prefix counts over the sources: no [R, R] comparison, so no
    shared-memory round per item) deals exactly the items of schedule.py's rule, skewed and empty
    sources and clipped totals included."""
    for walk in walks:
        if walk["case"]["every_peer"]:
            assert [[tuple(item) for item in program] for program in walk["items"]] == _rotation(walk["case"]), \
                walk["case"]


def test_every_peer_order_starts_the_programs_on_different_sources(walks):
    """4 sources, 4 programs: the first items cover every source; the rank-order walk (the old one)
    put every program on source 0, so every receiver read the same GPU at once."""
    by_order = {w["case"]["every_peer"]: w["items"] for w in walks if w["case"]["rows_per_source"] == [40] * 4}
    assert sorted(program[0][0] for program in by_order[True]) == [0, 1, 2, 3]
    assert [program[0][0] for program in by_order[False]] == [0, 0, 0, 0]


def test_every_peer_order_keeps_all_sources_busy_at_every_step(walks):
    """8 sources, 24 programs, equal rows: at every step each source has 3 programs on it."""
    walk = next(w for w in walks if w["case"]["programs"] == 24)
    for step in range(2):  # (64 blocks: two full steps of 24 programs)
        sources = Counter(program[step][0] for program in walk["items"])
        assert sorted(sources.values()) == [3] * 8, (step, sources)


def test_every_peer_order_deals_a_skewed_routing_evenly_over_the_programs(walks):
    """A hot source (100 rows of 220) and empty ones: no program gets more than one block more
    than another, and the hot source's blocks are spread over every program."""
    walk = next(w for w in walks if w["case"]["every_peer"] and w["case"]["rank"] == 5)
    sizes = [len(program) for program in walk["items"]]
    assert max(sizes) - min(sizes) <= 1
    assert all(any(source == 3 for source, _, _ in program) for program in walk["items"])


def test_setting_a_schedule_diagnostic_drops_the_plans_made_without_it():
    """NormalMode.every_peer / trace / pipelined_pull / rank_loop_reduce are compiled into the plans of
    a shape: setting one drops the plans (so the next call binds the kernels anew) and keeps the trace address the
    launches pass; the calls themselves look nothing up per diagnostic."""
    import torch
    from epcomm.backends.gpu.normal.one_node.mode import NormalMode
    mode = NormalMode.__new__(NormalMode)  # (no GPU here: only the diagnostics' bookkeeping)
    mode.bases, mode._dispatch_plans, mode._combine_plans = 4096, {"shape": "plan"}, {"shape": "plan"}
    vars(mode).update(every_peer=True, trace=None, pipelined_pull=False)
    mode.every_peer = False
    assert mode._dispatch_plans == {} and mode._combine_plans == {} and not mode.every_peer
    trace = torch.zeros(8, dtype=torch.int64)
    mode.trace = trace
    assert mode.trace_address == trace.data_ptr()
    mode.trace = None
    assert mode.trace_address == 4096
    mode._combine_plans = {"shape": "plan"}
    mode.rank_loop_reduce = False  # (the combine's reduce: compiled into its plans too)
    assert mode._combine_plans == {} and not mode.rank_loop_reduce


def test_the_combine_chunk_head_finds_each_pushers_blocks_in_either_form():
    """combine.chunk_blocks: the first and last block of each pusher that a chunk of tokens needs,
    from the [BLOCK_R, R_P2] tile and token by token (BY_TOKEN, the per-warp waits' form) alike —
    masked lanes, a short last chunk and tokens on no rank included (tests/chunk_blocks_cases.py)."""
    for line in run_cases("chunk_blocks_cases.py").splitlines():
        case = json.loads(line)
        assert case["results"]["False"] == case["results"]["True"] == case["results"]["reference"], case["case"]


def test_the_gathered_receive_index_holds_each_rows_entry_of_its_sources_list():
    """GATHER_INDEX (receive_index.py, list_entries_of_rows): each received row gets entry ``row -
    start`` of its source's list (source s's entry i is 1000 * s + i here), every row exactly once
    whatever the chunks and programs, empty sources skipped, rows past the clipped total untouched
    (-9), and no entry read past a list's count (-7 would show) — with the lists in the sources'
    workspaces or (PUSHED_LISTS) in the receiver's, where a wrong owner or row reads -7; and placed
    by list_of called as the stage calls it, read where the writer put them."""
    pushed_cases = written_cases = 0
    for line in run_cases("gather_index_cases.py").splitlines():
        walk = json.loads(line)
        case, src_idx = walk["case"], walk["src_idx"]
        counts = case["rows_per_source"]
        total = sum(counts)
        num_recv = min(total, case.get("num_rows", total))
        want = [1000 * s + i for s, n in enumerate(counts) for i in range(n)][:num_recv]
        assert src_idx == want + [-9] * (total + 3 - num_recv), case
        pushed_cases += bool(case.get("pushed"))
        written_cases += bool(case.get("written"))
    assert pushed_cases == 3 and written_cases == 2


def test_the_item_table_reads_each_pulls_items_per_rank():
    """scripts/trace_items.py's table (schedule_trace_cases.item_table): per call and rank the items,
    programs, span, median item time from this rank's rows and from its peers', the programs' busy
    share, and how far apart their first and last items were."""
    import schedule_trace_cases
    # [program, peer, rows, start ns, end ns]: rank 0 reads 8 rows of its own and 8 of peer 1's
    rank0 = {"full dispatch": [[0, 0, 8, 0, 2000], [1, 1, 8, 1000, 5000]], "cached dispatch": []}
    rank1 = {"full dispatch": [[0, 1, 8, 0, 1000], [0, 0, 8, 1000, 4000]], "cached dispatch": []}
    lines = schedule_trace_cases.item_table([rank0, rank1])
    assert lines[1].split() == ["full", "dispatch", "0", "2", "2", "5.0", "2.00", "4.00", "0.60", "1.0", "3.0", "3.2"]
    assert lines[2].split() == ["full", "dispatch", "1", "2", "1", "4.0", "1.00", "3.00", "1.00", "0.0", "0.0", "4.0"]
    assert "(no items)" in lines[3] and "(no items)" in lines[4]
