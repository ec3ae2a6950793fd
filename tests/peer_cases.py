"""epcomm beside DeepEP V1 with every rank on one GPU (the shared-GPU bed): the bench's paths for
the peer, run before a multi-GPU lease spends its minutes on them. Correctness only: the ranks
share the GPU's SMs, so the figures mean nothing.

DeepEP itself must be importable in the workers (``source scripts/gpu_env.sh; use_peer`` before
``scripts/shared_gpu.sh``); epcomm's own ``deep_ep`` package (compat/, first on the tests' path:
conftest.py) does not count."""
import contextlib
import os
import sys

NO_PEER = "no peer"


def _is_deep_ep(name: str) -> bool:
    return name == "deep_ep" or name.startswith("deep_ep.")


@contextlib.contextmanager
def deep_ep_itself():
    """While inside, ``import deep_ep`` gives DeepEP itself, not compat/'s package; yields the
    module, or an ImportError's text. The modules and the path as they were are back after, so the
    engine tests in the same worker still import compat/'s."""
    saved_path = list(sys.path)
    saved = {name: module for name, module in sys.modules.items() if _is_deep_ep(name)}
    compat = os.path.join("compat", "deep_ep")
    for name in saved:
        del sys.modules[name]
    sys.path[:] = [entry for entry in sys.path if not os.path.normpath(entry).endswith(compat)]
    try:
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


def bench_point_beside_the_peer(tokens: int = 256, hidden: int = 2048, sms: int = 8):
    """``epcomm bench normal``'s rank function with ``--peer deep_ep`` on one small point:
    ``{"ok", "checks", "peer_calls"}`` (the point's checks: epcomm's rows against NCCL's baseline,
    here on gloo, and DeepEP's; each library's num_worst_tokens rows, eager and from one CUDA
    graph, against its full dispatch), or NO_PEER and why. ``sms``: both libraries' Config
    (DeepEP's kernels wait for all their programs at once: every rank's must fit the one GPU)."""
    from epcomm.tools import bench
    with deep_ep_itself() as peer:
        if isinstance(peer, str) or "epcomm" in str(getattr(peer, "__version__", "")):
            return f"{NO_PEER} ({peer})"
        settings = bench.NormalBenchSettings(tokens=tokens, hidden=hidden, sms=sms, extra_tokens=[], reps=2,
                                             num_nvl_bytes=1 << 28, peer="deep_ep")
        result = bench.bench_normal_rank(settings)
    point = result["points"][0]
    return {"ok": point["ok"], "checks": point["checks"],
            "peer_calls": sorted(row["call"] for row in point["rows"] if "deep_ep" in row)}
