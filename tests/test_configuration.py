"""Configuration is arguments: the GPU kernels' settings are one Buffer argument (``epcomm.Tuning``)
read once where the Buffer is built, each with an operator's ``EPCOMM_*`` override read there too;
no module below buffer.py reads the environment (the transport setup only sets NVSHMEM's own
variables before NVSHMEM starts)."""
import ast
import os

import pytest

import epcomm
from epcomm import EPInputError, Tuning

SRC = os.path.join(os.path.dirname(__file__), "..", "src", "epcomm")
# Where reading the environment is allowed: the Buffer (where it is built) and what sits on top of
# it — the command-line tools and the test harness (epcomm.testing).
ABOVE_THE_BUFFER = ("buffer.py", "tools" + os.sep, "testing" + os.sep)


def _environment_uses(path: str):
    """``(line, text)`` of every ``os.environ`` / ``os.getenv`` / ``from os import environ`` in a file."""
    source = open(path).read()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        named = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv") and \
            isinstance(node.value, ast.Name) and node.value.id == "os"
        imported = isinstance(node, ast.ImportFrom) and node.module == "os" and \
            any(alias.name in ("environ", "getenv") for alias in node.names)
        if named or imported:
            yield node.lineno, lines[node.lineno - 1].strip()


def test_no_module_below_the_buffer_reads_the_environment():
    found = []
    for folder, _, files in os.walk(SRC):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, SRC)
            if rel.startswith(ABOVE_THE_BUFFER):
                continue
            for line, text in _environment_uses(path):
                sets_nvshmem = rel.startswith(os.path.join("backends", "gpu", "reach")) and '"NVSHMEM_' in text \
                    and ".get(" not in text
                if not sets_nvshmem:
                    found.append(f"{rel}:{line}: {text}")
    assert not found, ("read it in buffer.py and hand it down as an argument (epcomm.Tuning):\n" + "\n".join(found))


def test_tuning_defaults_are_the_measured_choices_and_bad_values_are_named():
    assert Tuning() == Tuning(ll_send_messages=0, ll_one_launch=None, ll_receive_programs=0, nvshmem_send_parts=1,
                              nvshmem_p2p=True)
    for field, value in (("nvshmem_send_parts", 0), ("ll_receive_programs", -1), ("ll_send_messages", 1.5),
                         ("ll_one_launch", 1), ("ll_one_launch", "auto"), ("nvshmem_p2p", "yes"),
                         ("nvshmem_p2p", None)):
        with pytest.raises(EPInputError) as raised:
            Tuning(**{field: value})
        assert raised.value.argument == f"tuning.{field}", raised.value


def buffer_built_with(variables: dict, tuning=None):
    """On a rank: a Buffer built with ``tuning`` under the environment ``variables``; returns what
    the Buffer recorded and what the backend was handed, or the EPInputError's argument."""
    import torch.distributed as dist

    import epcomm.buffer as buffer_module
    handed = {}
    real = buffer_module.create_backend

    def recording(*args):
        handed["tuning"] = args[-1]
        return real(*args)

    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    buffer_module.create_backend = recording
    try:
        buffer = epcomm.Buffer(dist.group.WORLD, tuning=tuning)
        return buffer.tuning, handed["tuning"]
    except EPInputError as err:
        return err.argument
    finally:
        buffer_module.create_backend = real
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_the_buffer_reads_tuning_once_where_it_is_built_and_the_variables_override_it(pools):
    pool = pools.get(1)
    asked = Tuning(ll_send_messages=2, nvshmem_send_parts=3)
    assert pool.run(buffer_built_with, {}, asked)[0] == (asked, asked)
    assert pool.run(buffer_built_with, {})[0] == (Tuning(), Tuning())
    variables = {"EPCOMM_LL_SEND_MESSAGES": "4", "EPCOMM_LL_ONE_LAUNCH": "1", "EPCOMM_LL_RECEIVE_PROGRAMS": "6",
                 "EPCOMM_NVSHMEM_SEND_PARTS": "2", "EPCOMM_NVSHMEM_P2P": "0"}
    want = Tuning(ll_send_messages=4, ll_one_launch=True, ll_receive_programs=6, nvshmem_send_parts=2,
                  nvshmem_p2p=False)
    assert pool.run(buffer_built_with, variables, asked)[0] == (want, want)
    assert pool.run(buffer_built_with, {"EPCOMM_LL_ONE_LAUNCH": "yes"})[0] == "EPCOMM_LL_ONE_LAUNCH"
    assert pool.run(buffer_built_with, {"EPCOMM_NVSHMEM_SEND_PARTS": "-1"})[0] == "EPCOMM_NVSHMEM_SEND_PARTS"
    assert pool.run(buffer_built_with, {}, {"nvshmem_p2p": False})[0] == "tuning"


def test_create_backend_hands_each_setting_to_the_gpu_backend_that_reads_it(monkeypatch):
    pytest.importorskip("triton")
    import torch

    from epcomm import backends
    from epcomm.backends.nvlink import backend as nvlink_backend
    from epcomm.backends.nvshmem import backend as nvshmem_backend
    made = {}

    def recorder(name):
        return lambda *args, **kwargs: made.setdefault(name, kwargs)
    monkeypatch.setattr(nvlink_backend, "NVLinkBackend", recorder("nvlink"))
    monkeypatch.setattr(nvshmem_backend, "NvshmemBackend", recorder("nvshmem"))
    tuning = Tuning(ll_send_messages=2, ll_one_launch=True, ll_receive_programs=5, nvshmem_send_parts=3,
                    nvshmem_p2p=False)
    for name in ("nvlink", "nvshmem"):
        backends.create_backend(name, None, torch.device("cuda"), 1 << 20, 1 << 20, True, 1.0, 2, True, False, tuning)
    low_latency = dict(ll_send_messages=2, ll_one_launch=True, ll_receive_programs=5)
    assert {k: made["nvlink"][k] for k in low_latency} == low_latency
    assert {k: made["nvshmem"][k] for k in low_latency} == low_latency
    assert made["nvshmem"]["send_parts"] == 3 and made["nvshmem"]["p2p"] is False


def test_both_gpu_backends_hand_the_low_latency_settings_to_their_mode():
    """Each GPU backend builds its LowLatencyMode with the Buffer's settings (their constructors
    cannot run without a GPU: read from the source, as the bed's cap test does)."""
    pytest.importorskip("triton")
    import inspect

    from epcomm.backends.gpu.low_latency import mode
    parameters = inspect.signature(mode.LowLatencyMode).parameters
    assert parameters["messages_per_program"].default == 0 and parameters["one_launch"].default is None
    # nvlink hands the setting on as it is (None: auto), ranks sharing its GPU too (the bed runs the
    # default users get); nvshmem takes two launches for None (not measured across nodes)
    for backend_name, handed in (("nvlink", "one_launch=ll_one_launch)"),
                                 ("nvshmem", "one_launch=bool(ll_one_launch))")):
        source = open(os.path.join(SRC, "backends", backend_name, "backend.py")).read()
        assert "messages_per_program=ll_send_messages," in source and handed in source, backend_name
