"""The first two-GPU run of the nvshmem backend (2 × H200, 2026-11-23) failed four ways; each root cause has a
check here that needs no GPU:

1./2. Desync and stale fingerprints: the signal-op codes were not the device library's (SET was
   0, which NVSHMEM 3.x treats as ADD: every epoch word summed up). The codes are pinned to the
   library's, and the loopback transport performs an op the way the library does (a store for
   SET, an add for any other code), so its GPU suite fails with a wrong code too.
3. ``nvshmemx_cumodule_init`` error 7: modules linked with the library but calling none of its
   functions have no device state; they are not initialised.
4. The automatic backend chose nvlink although ``ranks_per_node`` split the group into nodes.
"""
import types

import pytest
import torch.distributed as dist

import epcomm.backends as backends


def test_auto_backend_picks_nvshmem_when_the_nodes_split_the_group(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("EPCOMM_BACKEND", raising=False)
    import epcomm.backends.nvlink as nvlink
    monkeypatch.setattr(nvlink, "nvlink_usable", lambda group: True)
    monkeypatch.setattr(backends, "_everyone_has_nvshmem", lambda group: True)
    assert backends.default_backend_name(object()) == "nvlink"
    assert backends.default_backend_name(object(), None, 2) == "nvlink"  # one node of both ranks
    assert backends.default_backend_name(object(), None, 1) == "nvshmem"  # two (virtual) nodes
    monkeypatch.setattr(backends, "_everyone_has_nvshmem", lambda group: False)
    assert backends.default_backend_name(object(), None, 1) == "torch_dist"  # no NVSHMEM: the reference


try:  # the rest compiles kernels: Triton (not in the CPU CI's install)
    import triton
    from triton.backends.compiler import GPUTarget

    from epcomm.backends.gpu.reach import nvshmem as device
except ImportError:
    triton = None
needs_triton = pytest.mark.skipif(triton is None, reason="needs Triton (kernels compiled for sm_90)")


@needs_triton
def test_signal_codes_are_the_device_librarys():
    # nvshmemx_signal_op in libnvshmem_device.bc (NVSHMEM 3.4): `op == 9` stores, anything else adds
    assert device.SIGNAL_SET.value == 9 and device.SIGNAL_ADD.value == 10


if triton is not None:
    @triton.jit
    def _signal_kernel(words, value, OP: triton.language.constexpr, ONE_THREAD: triton.language.constexpr):
        device._loopback_signal(words.to(triton.language.int64), value, OP, ONE_THREAD)


@needs_triton
@pytest.mark.parametrize("one_thread", [False, True])
def test_loopback_signal_is_a_store_for_set_and_an_add_otherwise(one_thread):
    from epcomm.backends.gpu.launch import KernelSpec
    spec = KernelSpec(_signal_kernel, ["*i64", "i64"])
    target = GPUTarget("cuda", 90, 32)
    set_ptx = spec.compile(dict(OP=device.SIGNAL_SET.value, ONE_THREAD=one_thread), 4, target=target).asm["ptx"]
    add_ptx = spec.compile(dict(OP=device.SIGNAL_ADD.value, ONE_THREAD=one_thread), 4, target=target).asm["ptx"]
    assert "st.relaxed.sys.global.b64" in set_ptx and "red.relaxed.sys" not in set_ptx
    assert "red.relaxed.sys.global.add.u64" in add_ptx


@needs_triton
def test_modules_without_nvshmem_state_are_not_initialised(monkeypatch):
    import torch._C._distributed_c10d as c10d
    initialised = []
    monkeypatch.setattr(c10d, "_nvshmemx_cumodule_init", lambda module: initialised.append(module), raising=False)
    polls_only = types.SimpleNamespace(asm={"ptx": ".visible .entry ep_ll_dispatch() { ld.acquire.sys.global.b64 }"},
                                       module=1)
    calls_nvshmem = types.SimpleNamespace(asm={"ptx": ".visible .const .align 8 .b8 nvshmemi_device_state_d[64];"},
                                          module=2)
    device.NVSHMEM.init_module(polls_only)
    device.NVSHMEM.init_module(calls_nvshmem)
    assert initialised == [2]


@needs_triton
def test_receive_only_low_latency_kernels_call_no_nvshmem_function():
    """The kernel that broke the first run (the low-latency receive, REMOTE=nvshmem): no NVSHMEM
    call, so no device state in its module once linked — the init above must skip it."""
    from epcomm.backends.gpu import low_latency as L
    from epcomm.backends.gpu.reach import modes as reach
    ptx = L.DISPATCH.compile(dict(SEND=False, RECEIVE=True, USE_FP8=True, ROUND_SCALE=False, UE8M0=False,
                                  BLOCK_H=8192, MSGS=8, BLOCK_E=256, HAS_STATS=False, HAS_WAIT_STATS=True,
                                  BLOCK_X=1024, BLOCK_S=64, BLOCK_M=4, R_P2=8, ALIGNED=True,
                                  REMOTE=reach.FAR_BY_NVSHMEM), 8, target=GPUTarget("cuda", 90, 32),
                             ptx_options="--compile-only").asm["ptx"]
    assert "nvshmem" not in ptx and not device.module_uses_nvshmem(ptx)


@needs_triton
def test_loopback_process_loads_eagerly_and_allocates_stream_ordered():
    """The loopback ranks share one CUDA context: a module loaded at first launch, or a cudaMalloc
    between launches, orders a rank's next kernel behind its peers' spinning waits, which then run
    their whole timeout (a skipping rank's first case, H100 2026-11-26). The runner's process
    loads eagerly and allocates stream-ordered, unless the caller chose an allocator."""
    from loopback_suite import loopback_environment
    env = loopback_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "CUDA_MODULE_LOADING": "EAGER", "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    chosen = loopback_environment({"CUDA_MODULE_LOADING": "LAZY", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert chosen == {"CUDA_MODULE_LOADING": "EAGER", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
