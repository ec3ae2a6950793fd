"""Buffer asks its backend to refuse a normal-mode call it could not replay from a CUDA graph
(Backend.refuse_capture: on the GPU backends a full dispatch without num_worst_tokens, and every
call of the two-level mode) first, before anything else of the call runs: a resync, an abort or a
rejected layout's stand-in would be captured into the graph, not run. Checked on 2 CPU ranks with
the refusal stood in for (CUDA graphs need a GPU: tests/graph_cases.py)."""
import torch.distributed as dist

import epcomm
from epcomm.errors import EPError
from epcomm.testing.sweeps import make_routing, world


def refused_before_anything_else():
    """Every rank: a dispatch and a combine refused by the stand-in raise its EPError with nothing of
    the call run (no resync check, no pending report, no agreement); the backend is asked with the
    call's kind, handle and num_worst_tokens; once it stops refusing, the calls run and the
    dispatch's arguments carry the answer it gave (DispatchArgs.capturing)."""
    R, rank = world()
    buffer = epcomm.Buffer(dist.group.WORLD)
    backend = buffer._backend
    asked, touched, seen = [], [], []

    def refuse(kind, handle=None, num_worst_tokens=0):
        asked.append((kind, handle is None, num_worst_tokens))
        raise EPError(f"refused {kind}")

    for name in ("raise_pending", "agree", "check_dispatch", "check_combine"):
        original = getattr(backend, name)
        setattr(backend, name, lambda *a, _name=name, _original=original, **k: touched.append(_name) or _original(*a, **k))
    dispatch = backend.dispatch
    backend.dispatch = lambda args: seen.append(args.capturing) or dispatch(args)
    xs, topks, ws = make_routing(3, "uniform", R, 4 * R, 2, 8, 64)
    x, topk, w = xs[rank], topks[rank], ws[rank]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 4 * R)
    kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk, topk_weights=w)
    backend.refuse_capture = refuse
    touched.clear()
    try:
        buffer.dispatch(x, num_worst_tokens=16, **kwargs)
        raise AssertionError("the refusal did not raise")
    except EPError as err:
        assert str(err) == "refused dispatch" and touched == [], (err, touched)
    backend.refuse_capture = lambda kind, handle=None, num_worst_tokens=0: False
    recv = buffer.dispatch(x, **kwargs)
    assert seen == [False] and "check_dispatch" in touched
    backend.refuse_capture = refuse
    touched.clear()
    try:
        buffer.combine(recv[0], recv[4])
        raise AssertionError("the refusal did not raise")
    except EPError as err:
        assert str(err) == "refused combine" and touched == [], (err, touched)
    del backend.refuse_capture  # (the class's: torch_dist asks nothing)
    combined = buffer.combine(recv[0], recv[4])[0]
    assert combined.shape == x.shape
    assert asked == [("dispatch", True, 16), ("combine", True, 0)]
    return True


def test_a_refused_capture_raises_before_anything_else_of_the_call(pools):
    assert pools.get(2).run(refused_before_anything_else) == [True, True]

