"""epcomm beside DeepEP V1 with every rank on one GPU (the shared-GPU bed): the bench's paths for
the peer and the outputs and handles of both libraries on the same batches, run before a
multi-GPU lease spends its minutes on them. Correctness only: the ranks share the GPU's SMs, so
the figures mean nothing.

DeepEP itself must be importable in the workers: ``scripts/shared_gpu.sh`` installs the wheel
carried into .peers/ (gpu_env.sh's ``use_peer``, which also sets ``EPCOMM_PEER_CARRIED=1``: then a
DeepEP that does not import is a failure, not a skip). epcomm's own ``deep_ep`` package (compat/,
first on the tests' path: conftest.py) does not count."""
import contextlib
import os
import sys

import torch

NO_PEER = "no peer"
# where conftest.py puts compat/'s package on the path
COMPAT_PATH = os.path.normpath(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat",
                                            "deep_ep"))


def _is_deep_ep(name: str) -> bool:
    return name == "deep_ep" or name.startswith("deep_ep.")


def peer_required() -> bool:
    """Whether a DeepEP wheel was carried and installed for this run (gpu_env.sh, use_peer)."""
    return os.environ.get("EPCOMM_PEER_CARRIED") == "1"


@contextlib.contextmanager
def deep_ep_itself():
    """While inside, ``import deep_ep`` gives DeepEP itself, not compat/'s package; yields the
    module, or an ImportError's text. The modules and the path as they were are back after (also
    after an exception inside), so the engine tests in the same worker still import compat/'s."""
    saved_path = list(sys.path)
    saved = {name: module for name, module in sys.modules.items() if _is_deep_ep(name)}
    try:
        for name in saved:
            del sys.modules[name]
        sys.path[:] = [entry for entry in sys.path if os.path.normpath(os.path.abspath(entry)) != COMPAT_PATH]
        try:
            import deep_ep
            found = deep_ep
        except ImportError as exc:
            found = f"{type(exc).__name__}: {exc}"
        yield found
    finally:
        for name in [name for name in sys.modules if _is_deep_ep(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
        sys.path[:] = saved_path


def _no_peer(peer) -> str:
    """Why ``peer`` is not DeepEP itself, or "" where it is."""
    if isinstance(peer, str):
        return f"{NO_PEER} ({peer})"
    if "epcomm" in str(getattr(peer, "__version__", "")):
        return f"{NO_PEER} (the deep_ep found is epcomm's own package)"
    return ""


def bench_point_beside_the_peer(tokens: int = 256, hidden: int = 2048, sms: int = 8):
    """``epcomm bench normal``'s rank function with ``--peer deep_ep`` on one small point:
    ``{"ok", "checks", "peer_calls"}`` (the point's checks: epcomm's rows against NCCL's baseline,
    here on gloo, and DeepEP's; each library's num_worst_tokens rows, eager and from one CUDA
    graph, against its full dispatch), or NO_PEER and why. ``sms``: both libraries' Config
    (DeepEP's kernels wait for all their programs at once: every rank's must fit the one GPU)."""
    from epcomm.tools import bench
    with deep_ep_itself() as peer:
        if _no_peer(peer):
            return _no_peer(peer)
        settings = bench.NormalBenchSettings(tokens=tokens, hidden=hidden, sms=sms, extra_tokens=[], reps=2,
                                             num_nvl_bytes=1 << 28, peer="deep_ep")
        result = bench.bench_normal_rank(settings)
    point = result["points"][0]
    return {"ok": point["ok"], "checks": point["checks"],
            "peer_calls": sorted(row["call"] for row in point["rows"] if "deep_ep" in row)}


# DeepEP's one-node handle fields epcomm fills (handle.py); [2], recv_channel_prefix_matrix, is
# DeepEP's receiver-side bookkeeping of its channels, which epcomm's kernels do not have: None.
# Of [0], rank_prefix_matrix, the column of the rank that holds it: where DeepEP's count exchange
# wrote only the counts each rank receives, its other columns hold what the buffer held before.
COMPARED_FIELDS = {0: "rank_prefix_matrix[:, rank]", 1: "channel_prefix_matrix", 3: "recv_src_idx",
                   4: "is_token_in_rank", 5: "send_head"}


def _shown(value):
    """A small part of an output for a report: a tensor's shape, dtype and first rows."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype), value[:4].tolist())
    return repr(value)[:200]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if not isinstance(a, torch.Tensor):  # (the per-expert counts)
        return a == b
    if hasattr(a, "dtype") and a.dtype.is_floating_point and a.element_size() == 1:  # FP8: bit for bit
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())


def outputs_and_handles_beside_the_peer(num_cases: int = 6, tokens: int = 300, hidden: int = 2048,
                                        num_topk: int = 8, experts_per_rank: int = 32, sms: int = 8,
                                        against_compat: bool = False):
    """epcomm's and DeepEP's one-node normal mode on the same batches, output by output:
    get_dispatch_layout's four tensors; the full dispatch's rows (bf16, FP8 values and scales on
    odd cases), top-k ids and weights, per-expert counts (expert_alignment 1, 4, 128 in turn) and
    the handle's DeepEP fields (:data:`COMPARED_FIELDS`, read right after the dispatch: DeepEP's
    combine rewrites its send_head); a cached dispatch's rows; the combine's rows and weights
    (within bf16 rounding: the two sum in other orders). Every batch has other sizes and some
    top-k entries -1. Returns ``{"differed": {check: [cases where it differed]}, "details":
    {check: (ours, DeepEP's) at its first difference, shown small}}`` (the details also show
    rank_prefix_matrix whole where it differs off this rank's column: information, not a check),
    or NO_PEER and why.
    ``against_compat``: compare with compat/'s ``deep_ep`` (epcomm under DeepEP's API) on CPU
    ranks instead: the CPU test of this case's own code."""
    import torch.distributed as dist

    import epcomm
    from epcomm.fp8 import per_token_cast_to_fp8
    from epcomm.tools.measure import peer_buffer, random_batch, release_peer_buffers
    if against_compat:
        import deep_ep as compat  # (first on the tests' path: conftest.py)
    with contextlib.nullcontext(compat) if against_compat else deep_ep_itself() as peer:
        if not against_compat and _no_peer(peer):
            return _no_peer(peer)
        R, rank = dist.get_world_size(), dist.get_rank()
        dev = torch.device("cpu") if against_compat else torch.device("cuda", torch.cuda.current_device())
        num_experts = experts_per_rank * R
        ours = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 28)
        hint = peer.Config(sms, 8, 256).get_nvl_buffer_size_hint(hidden * 2, R)
        theirs = peer_buffer(peer, dist.group.WORLD, num_nvl_bytes=max(hint, 1 << 28))
        buffers = {"epcomm": (ours, epcomm.Config(sms, 8, 256)), "deep_ep": (theirs, peer.Config(sms, 8, 256))}
        differed, details = {}, {}

        def check(name: str, case: int, same: bool, ours=None, theirs=None) -> None:
            differed.setdefault(name, [])
            if not same:
                differed[name].append(case)
                details.setdefault(name, (case, _shown(ours), _shown(theirs)))

        for case in range(num_cases):
            # other sizes per rank and case, from tokens down to about tokens / (num_cases + 1)
            num_tokens = max(1, tokens - max(1, tokens // (num_cases + 1)) * case + 7 * rank)
            x, topk_idx, topk_weights = random_batch(num_tokens, hidden, num_topk, num_experts, 1000 * case + rank, dev)
            topk_idx[torch.rand(topk_idx.shape, device=dev) < 0.1] = -1  # some entries routed nowhere
            payload = per_token_cast_to_fp8(x) if case % 2 else x
            got = {}
            for name, (buffer, config) in buffers.items():
                layout = buffer.get_dispatch_layout(topk_idx, num_experts)
                per_rank, _, per_expert, in_rank, _ = layout
                recv, recv_topk, recv_weights, counts, handle, _ = buffer.dispatch(
                    payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=(1, 4, 128)[case % 3],
                    config=config)
                fields = {index: handle[index].clone() for index in COMPARED_FIELDS}  # (before any combine)
                fields["whole"] = fields[0]
                fields[0] = fields[0][:, rank]
                cached = buffer.dispatch(payload, handle=handle, config=config)[0]
                recv_x = recv[0] if isinstance(recv, tuple) else recv
                expert_out = (recv_x.float() * 0.5).to(torch.bfloat16) if case % 2 else recv_x
                combined, combined_weights, _ = buffer.combine(expert_out, handle, topk_weights=recv_weights,
                                                               config=config)
                got[name] = dict(layout=(layout[0], layout[2], layout[3]), recv=recv, recv_topk=recv_topk,
                                 recv_weights=recv_weights, counts=list(counts), fields=fields, cached=cached,
                                 combined=combined, combined_weights=combined_weights)
            a, b = got["epcomm"], got["deep_ep"]
            for key in ("layout", "recv", "recv_topk", "recv_weights", "counts", "cached"):
                check(key, case, _same(a[key], b[key]), a[key], b[key])
            for index, field in COMPARED_FIELDS.items():
                ours_field, their_field = a["fields"][index], b["fields"][index]
                check(f"handle[{index}] {field}", case, _same(ours_field, their_field), ours_field, their_field)
            if not _same(a["fields"]["whole"], b["fields"]["whole"]):
                details.setdefault("rank_prefix_matrix whole (information)",
                                   (case, _shown(a["fields"]["whole"]), _shown(b["fields"]["whole"])))
            check("combine", case, bool(torch.allclose(a["combined"].float(), b["combined"].float(), rtol=2e-2,
                                                       atol=2e-2)), a["combined"], b["combined"])
            check("combine's weights", case, bool(torch.allclose(a["combined_weights"], b["combined_weights"])),
                  a["combined_weights"], b["combined_weights"])
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        ours.destroy()
        release_peer_buffers(theirs)
        return {"differed": differed, "details": details}
