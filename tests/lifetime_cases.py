"""Buffers that end at different points on different ranks (run on every rank of a world).

A Buffer in a reference cycle ends when that process's collector runs, which differs between
ranks; on the nvshmem backend freeing symmetric memory is a barrier over every process, so such
frees must wait for an agreed point (backends/gpu/reach/symmetric_heap.py). A CPU run checks the
results; the shared-GPU suite runs it on the real NVSHMEM runtime, where the old frees hung.
"""
import gc
import warnings

import torch
import torch.distributed as dist

import epcomm
from epcomm.testing import reference_low_latency_combine
from epcomm.testing.sweeps import expert_fn, make_routing, world


def buffers_dropped_unevenly(rounds: int = 6, hidden: int = 512, backend=None, ranks_per_node=None):
    """Each round: a low-latency Buffer (two sizes in turn) makes a round trip that matches the
    reference, then is dropped — on some ranks into a reference cycle, collected at once on even
    ranks only. No round hangs or returns wrong data. Returns, where the memory is NVSHMEM's, the ledger's
    (id, bytes, let go of) per allocation once a last Buffer is destroyed (:func:`buffer_allocations`),
    and what holds those not let go of (:func:`who_holds`): every one should be let go of (no view
    of it left anywhere, PyTorch's rendezvous included)."""
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    num_experts, K = 4 * R, 4
    last = None
    for round_ in range(rounds + 1):
        M = 16 if round_ % 2 == 0 else 32
        size = epcomm.Buffer.get_low_latency_rdma_size_hint(M, hidden, R, num_experts)
        buffer = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True, backend=backend,
                               ranks_per_node=ranks_per_node)
        xs, topks, ws = make_routing(500 + round_, "uniform", R, num_experts, K, M, hidden, fixed_tokens=M)
        recv, count, handle, _, _ = buffer.low_latency_dispatch(xs[rank].to(dev), topks[rank].to(dev), M,
                                                                num_experts, use_fp8=False)
        num_local = num_experts // R
        experts = rank * num_local + torch.arange(num_local, device=dev)
        expert_out = (recv.float() * ((experts.float() + 1) / 8)[:, None, None]).to(torch.bfloat16)
        out = buffer.low_latency_combine(expert_out, topks[rank].to(dev), ws[rank].to(dev), handle)[0]
        want = reference_low_latency_combine(xs[rank], topks[rank], ws[rank], expert_fn, use_fp8=False)
        torch.testing.assert_close(out.cpu(), want, rtol=2e-2, atol=2e-2, msg=lambda m: f"round {round_}: {m}")
        if round_ == rounds:
            last = buffer
            break
        if (round_ + rank) % 3 == 0:  # this rank's Buffer ends only when its collector runs
            cycle = {"buffer": buffer}
            cycle["self"] = cycle
            del cycle
        del buffer, recv, handle, out
        if rank % 2 == 0:
            gc.collect()
    last.destroy()
    del last
    gc.collect()
    if dev.type != "cuda":
        return None
    from epcomm.backends.gpu.reach.symmetric_heap import process_heap
    group_ranks = dist.get_process_group_ranks(dist.group.WORLD)
    if not process_heap().allocations(group_ranks, dev):  # not NVSHMEM memory (the nvlink backend, a GPU per rank)
        return None
    held = buffer_allocations(process_heap(), group_ranks, dev)
    return held, who_holds(process_heap(), group_ranks, dev)


def who_holds(heap, group_ranks, device, depth: int = 6) -> dict:
    """{id: what keeps it} for each of the group's allocations (boards left out) not let go of:
    the owner's chain of referrers, or the views of its bytes and theirs (type names and
    attribute names, ``depth`` steps up). For the failure message of a bed run: a leak on the
    GPU is found from one run's log."""
    from epcomm.backends.gpu.call_board import kept_board_addresses
    from epcomm.backends.gpu.reach.symmetric_heap import storage_users
    boards = kept_board_addresses()
    found = {}
    for allocation in heap.allocations(group_ranks, device):
        if allocation.let_go() or allocation.tensor.data_ptr() in boards:
            continue
        owner = allocation.owner() if allocation.owner is not None else None
        if owner is not None:
            found[allocation.id] = "owner " + _referrer_chain(owner, depth)
            continue
        start, end = allocation.tensor.data_ptr(), allocation.tensor.data_ptr() + allocation.num_bytes
        with warnings.catch_warnings():  # (isinstance on every object touches deprecated module attributes)
            warnings.simplefilter("ignore")
            views = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj is not allocation.tensor
                     and obj.device == allocation.tensor.device and start <= _safe_data_ptr(obj) < end]
        found[allocation.id] = (f"{storage_users(allocation.tensor)} storage users ({allocation.users_alone} alone); "
                                + "; ".join(f"view {tuple(v.shape)} " + _referrer_chain(v, depth) for v in views[:4]))
    return found


def _safe_data_ptr(tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # (a tensor without storage: a fake or meta tensor)
        return -1


def _referrer_chain(obj, depth: int) -> str:
    """``obj``'s first non-frame referrers, ``depth`` steps up: "Type.attribute <- Type ..."."""
    import types
    steps, current, seen = [], obj, {id(obj)}
    for _ in range(depth):
        found = gc.get_referrers(current)
        referrers = [r for r in found if id(r) not in seen and not isinstance(r, types.FrameType) and r is not steps]
        found.clear()  # (these lists would show up as the next step's referrers)
        if not referrers:
            steps.append("(no referrer)")
            break
        parent = referrers[0]
        others = [type(r).__name__ for r in referrers[1:4]]
        referrers.clear()
        if isinstance(parent, dict):  # an object's __dict__ (where not inlined): the object owning it
            owners = [o for o in gc.get_referrers(parent) if getattr(o, "__dict__", None) is parent]
            seen.add(id(parent))
            parent = owners[0] if owners else parent
        fields = parent if isinstance(parent, dict) else getattr(parent, "__dict__", {})
        names = [k for k, v in fields.items() if v is current]
        steps.append(type(parent).__name__ + (f".{names[0]}" if names else "") + (f" (+{others})" if others else ""))
        seen.add(id(parent))
        current = parent
    return " <- ".join(steps)


def buffer_allocations(heap, group_ranks, device):
    """(id, bytes, let go of) per allocation of the group in ``heap`` that a Buffer took: the call
    boards (one per process group, gpu/call_board.py) stay for the process's life by design, so an
    earlier test's groups (an engine's own gloo group, say) leave theirs held in the same ledger."""
    from epcomm.backends.gpu.call_board import kept_board_addresses
    boards = kept_board_addresses()
    return [(a.id, a.num_bytes, a.let_go()) for a in heap.allocations(group_ranks, device)
            if a.tensor.data_ptr() not in boards]
