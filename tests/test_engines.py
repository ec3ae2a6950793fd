"""Engines unchanged: ``import deep_ep`` (the opt-in package in compat/deep_ep) driven the way
vLLM, SGLang and Megatron-Core drive DeepEP, on 4 CPU ranks; and the package's install rules."""
import os
import subprocess
import sys

import pytest

import engine_cases

COMPAT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat", "deep_ep")


def test_deep_ep_dropin(pools):
    """vLLM's and SGLang's deep_ep.Buffer calls run unchanged on epcomm.compat.deep_ep: DeepEP V1's
    whole constructor, configs, normal and low-latency keywords."""
    assert pools.get(2).run(engine_cases.deep_ep_dropin) == [True, True]


DEEP_EP_V1_CONSTRUCTOR = (("group", None), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                          ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                          ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False))


def test_deep_ep_buffer_shows_deep_ep_v1_signature_and_lists_its_arguments():
    """inspect.signature / help(deep_ep.Buffer): DeepEP V1's ten constructor arguments with its
    defaults, in order, positional-or-keyword; epcomm's own only after them, keyword-only; the
    docstring names every one."""
    import inspect
    import pydoc
    import epcomm.compat.deep_ep as deep_ep
    parameters = list(inspect.signature(deep_ep.Buffer).parameters.values())
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in parameters[:10]] == \
        list(DEEP_EP_V1_CONSTRUCTOR)
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters[:10])
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[10:])
    text = pydoc.render_doc(deep_ep.Buffer)
    assert "Same arguments" not in text
    for name, _ in DEEP_EP_V1_CONSTRUCTOR:
        assert f"{name}:" in deep_ep.Buffer.__doc__, name


def test_backend_argument_and_override(pools):
    assert pools.get(2).run(engine_cases.backend_argument) == [True, True]


def test_vllm_high_throughput_prepare_finalize_on_its_gloo_group(pools):
    assert pools.get(4).run(engine_cases.vllm_high_throughput) == [3] * 4


@pytest.mark.parametrize("case", ["vllm_high_throughput", "vllm_low_latency", "sglang_dispatchers", "megatron_fused"])
def test_an_engine_case_gives_the_callers_num_sms_back(pools, case):
    """vLLM calls Buffer.set_num_sms(20), a process-wide setting: each case gives the caller's
    count back, so the next case in the same process runs with its own (the one-GPU bed's cap)."""
    assert pools.get(4).run(engine_cases.leaves_num_sms_as_found, case) == [(6, 6)] * 4


def test_vllm_low_latency_prepare_finalize_hooks_out_masks_and_nvfp4(pools):
    assert pools.get(4).run(engine_cases.vllm_low_latency) == [True] * 4


def test_sglang_normal_and_low_latency_dispatchers_on_one_buffer(pools):
    assert pools.get(4).run(engine_cases.sglang_dispatchers) == [True] * 4


@pytest.mark.parametrize("async_finish", [False, True])
def test_megatron_fused_dispatch_combine_forward_and_backward_match_dense(pools, async_finish):
    assert pools.get(4).run(engine_cases.megatron_fused, async_finish=async_finish) == [True] * 4


def test_package_installs_with_pip_and_says_it_is_epcomm(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), COMPAT], check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target)] + sys.path))
    out = subprocess.run([sys.executable, "-c", "import deep_ep, deep_ep.utils, deep_ep.buffer; "
                          "print(deep_ep.__version__, deep_ep.Buffer.__module__, deep_ep.utils.EventHandle.__name__)"],
                         env=env, capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert "epcomm" in out[0] and out[1] == "epcomm.compat.deep_ep" and out[2] == "EventHandle"


def _fake_deep_ep(where):
    (where / "deep_ep").mkdir(parents=True)
    (where / "deep_ep" / "__init__.py").write_text("from deep_ep_cpp import Config\n")
    (where / "deep_ep_cpp.py").write_text("Config = None\n")


def test_install_check_finds_a_real_deep_ep_and_not_this_package(tmp_path):
    sys.path.insert(0, COMPAT)
    try:
        from install_check import real_deep_ep_in
    finally:
        sys.path.remove(COMPAT)
    _fake_deep_ep(tmp_path / "real")
    assert "deep_ep" in real_deep_ep_in(sys.executable, dict(os.environ, PYTHONPATH=str(tmp_path / "real")))
    assert real_deep_ep_in(sys.executable, dict(os.environ, PYTHONPATH=COMPAT)) == ""


def test_pip_refuses_to_install_over_a_real_deep_ep(tmp_path):
    _fake_deep_ep(tmp_path / "real")
    env = dict(os.environ, EPCOMM_DEEP_EP_SEARCH_PATH=str(tmp_path / "real"))
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                             "--target", str(tmp_path / "real"), COMPAT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0 and "DeepEP itself is installed" in result.stdout + result.stderr
    assert (tmp_path / "real" / "deep_ep" / "__init__.py").read_text().startswith("from deep_ep_cpp")


@pytest.mark.parametrize("backend_string, requested, cuda, want", [
    ("gloo", None, True, "cpu"),                    # native epcomm.Buffer: a gloo group is the CPU reference
    ("gloo", "cuda", True, "cuda"),                 # vLLM's gloo group on GPU ranks (deep_ep.Buffer's default)
    ("nccl", None, True, "cuda"),
    ("cpu:gloo,cuda:nccl", None, True, "cuda"),     # mixed groups
    ("cpu:gloo,cuda:gloo", None, True, "cuda"),     # several ranks on one GPU
    ("nccl", "cpu", True, "cpu"),
    ("gloo", None, False, "cpu"),
])
def test_buffer_device_follows_the_group_unless_asked(backend_string, requested, cuda, want):
    from epcomm.backends import choose_device
    assert choose_device(backend_string, requested, cuda) == want


def test_device_cuda_without_cuda_is_an_input_error_naming_device(pools):
    assert pools.get(2).run(engine_cases.device_cuda_without_cuda) == [True, True]


def test_local_buffer_view_checks_dtype_offset_and_size():
    import torch
    from epcomm.checks import view_of_bytes
    from epcomm.errors import EPInputError
    memory = torch.arange(64, dtype=torch.uint8)
    assert view_of_bytes(memory, torch.int32).numel() == 16
    assert view_of_bytes(memory, torch.float32, offset=8).numel() == 14
    assert view_of_bytes(memory, torch.uint8, torch.Size([2, 3]), 4).tolist() == [[4, 5, 6], [7, 8, 9]]
    for kwargs, name in (({"dtype": "int32"}, "dtype"), ({"dtype": torch.int32, "offset": 3}, "offset"),
                         ({"dtype": torch.int32, "size": (17,)}, "size")):
        with pytest.raises(EPInputError, match=name):
            view_of_bytes(memory, **kwargs)


def test_import_says_it_is_epcomm_when_logging_asks():
    """One line at import (rank 0, or no process group) with logging at INFO; silent otherwise."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([COMPAT] + sys.path))
    code = "import logging, sys; logging.basicConfig(level=getattr(logging, sys.argv[1])); import deep_ep"
    said = subprocess.run([sys.executable, "-c", code, "INFO"], env=env, capture_output=True, text=True, timeout=120)
    quiet = subprocess.run([sys.executable, "-c", code, "WARNING"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert said.returncode == 0 and "is epcomm" in said.stderr, said.stderr
    assert quiet.returncode == 0 and "epcomm" not in quiet.stderr, quiet.stderr
