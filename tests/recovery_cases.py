"""A call that raised on every rank leaves a GPU Buffer usable: the bodies of the recovery cases
(test_gpu.py, test_shared_gpu.py), run on every rank of a WorkerPool."""
from __future__ import annotations

import torch
import torch.distributed as dist

import epcomm
from epcomm.testing.sweeps import make_routing, world
from failure_cases import _layout_args, _outcome

GPU_RECOVERY_CASES = ("all_bad", "one_bad", "disagree", "layout", "ll_one_bad")


def gpu_recovery(case: str, timeout: float = 10.0):
    """A rejected call and a disagreement on the group's GPU backend (nvlink on one node; nvshmem on virtual
    nodes): a call that raised on every rank leaves the Buffer usable — the next call pairs (every
    rank that raised resyncs there) and matches the reference. Returns ``(what the failing step
    raised on this rank, after-checks passed)``."""
    from epcomm.testing import reference_dispatch, reference_low_latency_combine
    from epcomm.testing.sweeps import expert_fn, rank_fn
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    E, K, T, M, H = 4 * R, 2, 64, 32, 256
    ll = case.startswith("ll_")
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, low_latency_mode=ll,
                           num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E) if ll else 0,
                           timeout=timeout, check_values=case == "layout")
    odd = rank == R - 1

    def routing(seed, tokens):
        xs, topks, ws = make_routing(seed, "uniform", R, E, K, tokens, H, fixed_tokens=tokens)
        return xs, topks, ws, xs[rank].to(dev), topks[rank].to(dev), ws[rank].to(dev)

    def normal_step(seed):
        xs, topks, ws, x, topk, w = routing(seed, T)
        recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **_layout_args(buffer, topk, E))
        combined = buffer.combine(rank_fn(rank, recv_x), handle)[0]
        ok = torch.equal(recv_x.cpu(), reference_dispatch(xs, topks, ws, E)[rank]["recv_x"])
        from epcomm.testing import reference_combine
        return ok and torch.allclose(combined.float().cpu(), reference_combine(xs[rank], topks[rank], E, R, rank_fn)
                                     .float(), rtol=2e-2, atol=2e-2)

    def ll_step(seed):
        xs, topks, ws, x, topk, w = routing(seed, M)
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False)
        experts = rank * (E // R) + torch.arange(E // R, device=dev)
        out = expert_fn(experts.repeat_interleave(R * M), recv.float().reshape(-1, H)).reshape(recv.shape)
        combined = buffer.low_latency_combine(out.to(torch.bfloat16), topk, w, handle)[0]
        want = reference_low_latency_combine(xs[rank], topks[rank], ws[rank], expert_fn, use_fp8=False)
        ok = torch.allclose(combined.float().cpu(), want.float(), rtol=2e-2, atol=2e-2)
        if not ok:  # what went wrong, for the log
            got = combined.float().cpu()
            bad = ~torch.isclose(got, want.float(), rtol=2e-2, atol=2e-2)
            print(f"rank {rank} ll_step({seed}): {int(torch.isnan(got).sum())} NaN, {int(bad.sum())} of {got.numel()} "
                  f"values off in tokens {bad.any(1).nonzero().flatten().tolist()[:16]}; recv counts "
                  f"{count.tolist()}", flush=True)
            try:  # the host reports what the kernels found at the next call
                buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False)
                torch.cuda.synchronize()
                print(f"rank {rank} ll_step({seed}): the next call raised nothing", flush=True)
            except Exception as exc:  # noqa: BLE001 (a diagnostic)
                print(f"rank {rank} ll_step({seed}): the next call raised {type(exc).__name__}: {exc}", flush=True)
        return ok

    xs, topks, ws, x, topk, w = routing(60, T)
    if case == "ll_one_bad":
        assert ll_step(59)  # a decode loop that ran before
        xs, topks, ws, x, topk, w = routing(60, M)
        first = _outcome(lambda: buffer.low_latency_dispatch(torch.cat([x, x[:1]]) if odd else x, topk, M, E,
                                                             use_fp8=False))
        if first[0] == "ok":  # a low-latency call does not wait on the host: the next call reports it
            torch.cuda.synchronize()
            first = _outcome(lambda: buffer.low_latency_dispatch(x, topk, M, E, use_fp8=False))
        return first[:2], [ll_step(61), ll_step(62)]
    if case == "layout":
        bad = topk.clone()
        if rank == 1:
            bad[0, 0] = E + 3
        def call():
            args = _layout_args(buffer, bad, E)
            return buffer.dispatch(x, topk_idx=bad, topk_weights=w, **args)
        first = _outcome(call)
        return first[:2] + (("rank 1" in first[2]) if len(first) == 3 else None,), [normal_step(61), normal_step(62)]
    payload = x
    if case == "all_bad" or (case == "one_bad" and odd):
        payload = x.float()
    elif case == "disagree" and odd:
        payload = epcomm.per_token_cast_to_fp8(x)
    first = _outcome(lambda: buffer.dispatch(payload, topk_idx=topk, topk_weights=w, **_layout_args(buffer, topk, E)))
    return first[:2], [normal_step(61), normal_step(62)]


def gpu_host_stall_before_the_doorbell(timeout: float = 0.5):
    """A full dispatch whose host thread stalls between its count wait and the doorbell longer than
    the launch waits for it (2 x timeout; mailbox.py, ring): the call raises EPTimeoutError saying
    so (its outputs were never written), and the next call matches the reference. Returns ``(what
    the stalled call raised, the next call matched)``."""
    import time

    from epcomm.testing import reference_dispatch
    R, rank = world()
    dev = torch.device("cuda", torch.cuda.current_device())
    E, K, T, H = 4 * R, 2, 64, 256
    buffer = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=64 << 20, backend="nvlink", timeout=timeout)
    buffer._backend.normal.doorbell_dispatch = True  # (off by default: mode.py says why)
    xs, topks, ws = make_routing(3, "uniform", R, E, K, T, H, fixed_tokens=T)
    x, topk, w = xs[rank].to(dev), topks[rank].to(dev), ws[rank].to(dev)
    mailbox = buffer._backend.mailbox
    ring = mailbox.ring

    def stalled_ring(sequence, *args):
        time.sleep(3 * timeout)
        return ring(sequence, *args)
    mailbox.ring = stalled_ring
    try:
        buffer.dispatch(x, topk_idx=topk, topk_weights=w, **_layout_args(buffer, topk, E))
        torch.cuda.synchronize()
        first = "no error"
    except epcomm.EPTimeoutError as err:
        first = "EPTimeoutError" if "allocate its outputs" in str(err) else str(err)
    finally:
        del mailbox.ring  # (the instance attribute: the class's ring again)
    recv_x = buffer.dispatch(x, topk_idx=topk, topk_weights=w, **_layout_args(buffer, topk, E))[0]
    matched = torch.equal(recv_x.cpu(), reference_dispatch(xs, topks, ws, E)[rank]["recv_x"])
    buffer.destroy()
    return first, matched
