"""Is a real DeepEP importable by an interpreter? (used by setup.py, and by the tests)"""
import os
import subprocess

# Run by the interpreter being asked: where `deep_ep` and DeepEP's extension `deep_ep_cpp` are,
# without importing them (DeepEP's import loads CUDA code). epcomm's package says so in a marker.
_PROBE = r"""
import importlib.util, os
spec = importlib.util.find_spec("deep_ep")
ext = importlib.util.find_spec("deep_ep_cpp")
ours = False
if spec is not None and spec.origin and os.path.exists(spec.origin):
    ours = "EPCOMM_DEEP_EP_PACKAGE" in open(spec.origin, encoding="utf-8", errors="replace").read()
where = [s.origin for s in (spec, ext) if s is not None and not (s is spec and ours)]
print("|".join(w or "?" for w in where))
"""


def real_deep_ep_in(python: str, env=None) -> str:
    """Where ``python`` finds DeepEP's own ``deep_ep`` or ``deep_ep_cpp`` ("" when it finds neither,
    or only this package). ``env``: the environment to run it in (default: this one without the
    variables pip's isolated build sets, so the installing interpreter's own paths are searched)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
        # directories searched first, e.g. the one `pip install --target DIR` installs into
        if os.environ.get("EPCOMM_DEEP_EP_SEARCH_PATH"):
            env["PYTHONPATH"] = os.environ["EPCOMM_DEEP_EP_SEARCH_PATH"]
    result = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=60)
    return result.stdout.strip() if result.returncode == 0 else ""
