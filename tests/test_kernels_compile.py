"""Every nvlink kernel specialisation the hot paths use compiles for sm_90 (no GPU needed: Triton
compiles for a named target). Skipped where Triton is not installed (CI installs only torch)."""
import itertools

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from epcomm.backends.gpu import agreement as A  # noqa: E402
from epcomm.backends.gpu import expert_major_kernels as EM  # noqa: E402
from epcomm.backends.gpu import low_latency as L  # noqa: E402
from epcomm.backends.gpu.normal import layout_kernel, one_node as N  # noqa: E402
from epcomm.backends.gpu import mailbox as MB  # noqa: E402
from epcomm.backends.gpu.reach.modes import FAR_BY_LOOPBACK, FAR_BY_NVSHMEM  # noqa: E402
from epcomm.backends.gpu.reach.nvshmem import NVSHMEM  # noqa: E402


def _cases():
    yield MB._probe_kernel, {}, 1
    for nodes in (False, True):
        yield N.LAYOUT, dict(BLOCK_T=128, E_P2=256, K_P2=8, R_P2=8, N_P2=4 if nodes else 1, HAS_NODES=nodes,
                             SUM_ROWS=32), 4
    yield N.NOTIFY, dict(R_P2=8, BLOCK=256), 4
    for word_bytes in (8, 4):
        yield EM.EXPAND, dict(WORD_BYTES=word_bytes, BLOCK_R=2, BLOCK_W=1024), 8
    yield EM.FOLD, dict(BLOCK_R=4, K_P2=8), 4
    yield A.ABORT, dict(R_P2=8, BLOCK_L=128, REMOTE=0), 4
    yield A.POST_RESYNC, dict(R_P2=8, REMOTE=0), 1
    copy = dict(BLOCK_R=8, BLOCK_W=2048, S_P2=64, K_P2=8, R_P2=8)
    for fp8, topk, lists, al, em in itertools.product([False, True], repeat=5):
        if not em or topk:  # expert-major positions are staged with the top-k rows
            yield N.STAGE, dict(HAS_SCALES=fp8, HAS_TOPK=topk, WRITE_LISTS=lists, LIST_BLOCK=1024, L_P2=128,
                                PUSHED_LISTS=lists and topk != al,
                                ALIGNED=al, EXPERT_MAJOR=em, POSITION_TOKENS=128, E_P2=256, POSITION_SUB=16, **copy), 16
            if lists and fp8 == al:  # (a full dispatch's round 0, with its count exchange)
                yield N.NOTIFY_STAGE, dict(HAS_SCALES=fp8, HAS_TOPK=topk, WRITE_LISTS=True, LIST_BLOCK=1024, L_P2=128,
                                           PUSHED_LISTS=topk or em, ALIGNED=al, EXPERT_MAJOR=em, POSITION_TOKENS=128,
                                           E_P2=256, POSITION_SUB=16, BLOCK=256, **copy), 16
        yield N.PULL, dict(INDEX=lists, HAS_SCALES=fp8, HAS_TOPK=topk, ALIGNED=al, EXPERT_MAJOR=em, EVERY_PEER=True,
                           TRACE=lists and al, PIPELINE=not em and fp8 == al, SIDE_FIRST=topk != al,
                           GATHER_INDEX=lists and fp8 != al, PUSHED_LISTS=lists and topk == fp8, **copy), 16
    for (index, fp8, topk), al in itertools.product([(True, False, True), (True, True, True), (True, False, False),
                                                    (False, False, False), (False, True, False)], [False, True]):
        # (DOORBELL: a full dispatch launched before the count wait; without, a num_worst_tokens one)
        yield N.STAGE_PULL, dict(INDEX=index, WRITE_LISTS=index, HAS_SCALES=fp8, HAS_TOPK=topk, LIST_BLOCK=1024,
                                 PUSHED_LISTS=index and al,
                                 L_P2=128 if index else 1, ALIGNED=al, OUT_ALIGNED=True, EVERY_PEER=True,
                                 TRACE=al and not fp8, DOORBELL=index and (al or not topk), SIDE_FIRST=fp8 or topk,
                                 NOTIFY=index and not (al or not topk), NOTIFY_BLOCK=256, **copy), 16
    for weights, num_bias, al in itertools.product([False, True], [0, 1, 2], [False, True]):
        for em in ([False, True] if num_bias == 0 and not weights else [False]):
            yield N.PUSH, dict(HAS_WEIGHTS=weights, BLOCK_R=8, BLOCK_W=2048, K_P2=8, R_P2=8, ALIGNED=al,
                               EXPERT_MAJOR=em, EVERY_PEER=not (weights and al), TRACE=weights and al), 16
        yield N.REDUCE, dict(NUM_BIAS=num_bias, HAS_WEIGHTS=weights, R_P2=8, BLOCK_C=2048, K_P2=8, ALIGNED=al,
                             RANK_LOOP=al), 16
        yield N.PUSH_REDUCE, dict(HAS_WEIGHTS=weights, BLOCK_R=8, BLOCK_W=2048, K_P2=8, R_P2=8, ALIGNED=al,
                                  EXPERT_MAJOR=False, EVERY_PEER=True, TRACE=weights and al, NUM_BIAS=num_bias,
                                  BLOCK_C=2048, OUT_ALIGNED=not al, RANK_LOOP=weights != al,
                                  WARPS_APART=weights != al and num_bias == 0), 16
    for (fp8, round_scale, ue8m0), al in itertools.product(
            [(True, False, False), (True, True, False), (True, True, True), (False, False, False)], [False, True]):
        for send, receive, msgs in ((True, True, 8), (True, False, 4), (False, True, 8)):
            yield L.DISPATCH, dict(SEND=send, RECEIVE=receive, USE_FP8=fp8, ROUND_SCALE=round_scale, UE8M0=ue8m0,
                                   BLOCK_H=8192, MSGS=msgs, BLOCK_E=256, HAS_STATS=al, HAS_WAIT_STATS=not al,
                                   BLOCK_X=1024, BLOCK_S=64, BLOCK_M=4, R_P2=8, ALIGNED=al, REMOTE=0), 8
    for (send, receive), wait_stats, al in itertools.product([(True, True), (True, False), (False, True)],
                                                             [False, True], [False, True]):
        yield L.COMBINE, dict(SEND=send, RECEIVE=receive, HAS_WAIT_STATS=wait_stats, BLOCK_W=2048, K_P2=8,
                              BLOCK_C=1024, R_P2=8, ALIGNED=al, REMOTE=0), 8


def _access_widths(spec, constexprs, num_warps):
    """Global load/store instructions of a compiled specialisation, by access width."""
    import collections
    import re
    ptx = spec.compile(constexprs, num_warps, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return collections.Counter(re.findall(r"\b(?:st|ld)\.global((?:\.v[24])?\.b\d+)", ptx))


@pytest.mark.parametrize("spec,constexprs,num_warps", list(_cases()),
                         ids=lambda v: v.name if hasattr(v, "name") else None)
def test_kernel_compiles_for_sm90(spec, constexprs, num_warps):
    compiled = spec.compile(constexprs, num_warps, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]


def test_spec_rejects_wrong_type_count():
    from epcomm.backends.gpu.launch import KernelSpec
    from epcomm.errors import EPError
    with pytest.raises(EPError, match="runtime parameters"):
        KernelSpec(layout_kernel.ep_dispatch_layout, ["*i64"])


def test_spec_library_if_names_a_constexpr():
    """``library_if`` must name one of the kernel's constexprs; the two-level kernels link NVSHMEM
    only where REMOTE is FAR_BY_NVSHMEM (the loopback test transport links no library)."""
    from epcomm.backends.gpu.launch import KernelSpec
    from epcomm.backends.gpu.reach import modes as reach
    from epcomm.backends.gpu.reach import nvshmem as device
    from epcomm.backends.gpu.normal.two_level import step
    from epcomm.errors import EPError
    with pytest.raises(EPError, match="REMOTES"):
        types = [t for t in step.STEP.signature.values() if t != "constexpr"]
        KernelSpec(step.ml_dispatch_step, types, library=device.NVSHMEM, library_if=("REMOTES", 1))
    assert step.STEP.library_of(dict(REMOTE=reach.FAR_BY_LOOPBACK, R_P2=2)) is None
    assert step.STEP.library_of(dict(REMOTE=reach.FAR_BY_NVSHMEM, R_P2=2)) is device.NVSHMEM


def test_spec_library_if():
    """``library_if=(constexpr, value)``: the library only where the constexpr has that value (the
    low-latency kernels link NVSHMEM only with REMOTE=FAR_BY_NVSHMEM)."""
    from epcomm.backends.gpu.reach import modes as reach
    assert L.DISPATCH.library_of(dict(REMOTE=reach.PEERS_BY_STORES)) is None
    assert L.DISPATCH.library_of(dict(REMOTE=reach.FAR_BY_LOOPBACK)) is None
    assert L.COMBINE.library_of(dict(REMOTE=reach.FAR_BY_NVSHMEM)).name == "libnvshmem_device"
    assert A.ABORT.library_of(dict(REMOTE=reach.FAR_BY_NVSHMEM)).name == "libnvshmem_device"


@pytest.mark.parametrize("remote", [1, 2])
def test_low_latency_kernels_with_far_peers_compile(remote):
    """The low-latency kernels and the abort with peers on other nodes: NVSHMEM calls (left to the
    library) or the loopback copies; without REMOTE they hold no NVSHMEM call (the nvlink cases above)."""
    target = GPUTarget("cuda", 90, 32)
    options = dict(ptx_options="--compile-only" if remote == 1 else None)
    for fp8, send, receive in ((True, True, False), (False, True, True), (False, False, True)):
        compiled = L.DISPATCH.compile(dict(SEND=send, RECEIVE=receive, USE_FP8=fp8, ROUND_SCALE=fp8, UE8M0=False,
                                           BLOCK_H=8192, MSGS=8, BLOCK_E=256, HAS_STATS=False, HAS_WAIT_STATS=True,
                                           BLOCK_X=1024, BLOCK_S=64, BLOCK_M=4, R_P2=8, ALIGNED=True, REMOTE=remote),
                                      8, target=target, **options)
        assert ("nvshmemx_putmem_nbi_block" in compiled.asm["ptx"]) == (remote == 1 and send)
    for send, receive in ((True, False), (False, True), (True, True)):
        compiled = L.COMBINE.compile(dict(SEND=send, RECEIVE=receive, HAS_WAIT_STATS=False, BLOCK_W=2048, K_P2=8,
                                          BLOCK_C=1024, R_P2=8, ALIGNED=False, REMOTE=remote), 8,
                                     target=target,
                                     **options)
        assert ("nvshmemx_signal_op" in compiled.asm["ptx"]) == (remote == 1 and send)
    abort = A.ABORT.compile(dict(R_P2=8, BLOCK_L=128, REMOTE=remote), 4, target=target,
                            **options)
    assert ("nvshmem_quiet" in abort.asm["ptx"]) == (remote == 1)
    # a resyncing rank's RESYNC on every peer's call board: signals, completed before the kernel ends
    resync = A.POST_RESYNC.compile(dict(R_P2=8, REMOTE=remote), 1, target=target, **options)
    assert ("nvshmemx_signal_op" in resync.asm["ptx"]) == ("nvshmem_quiet" in resync.asm["ptx"]) == (remote == 1)


def test_nvlink_kernels_hold_no_nvshmem_call():
    target = GPUTarget("cuda", 90, 32)
    ptx = L.COMBINE.compile(dict(SEND=True, RECEIVE=False, HAS_WAIT_STATS=False, BLOCK_W=2048, K_P2=8, BLOCK_C=1024,
                                 R_P2=8, ALIGNED=False, REMOTE=0), 8, target=target).asm["ptx"]
    assert "nvshmem" not in ptx


def test_nvshmem_backend_channel_limit():
    """Signal words have room for MAX_CHANNELS channels per node: more is an EPInputError naming config."""
    from epcomm.backends.gpu.normal.two_level.areas import MAX_CHANNELS
    from epcomm.backends.gpu.normal.two_level.mode import TwoLevelMode
    from epcomm.config import Config
    from epcomm.errors import EPInputError
    assert TwoLevelMode._num_channels(Config(num_sms=2 * MAX_CHANNELS)) == MAX_CHANNELS
    with pytest.raises(EPInputError) as err:
        TwoLevelMode._num_channels(Config(num_sms=2 * MAX_CHANNELS + 2))
    assert err.value.argument == "config"


# Copies move 16 bytes per access when ALIGNED (copy.py): the compiler must see the alignment.
@pytest.mark.parametrize("spec,constexprs,num_warps", [
    (N.STAGE, dict(HAS_SCALES=False, HAS_TOPK=False, WRITE_LISTS=False, PUSHED_LISTS=False,
                   LIST_BLOCK=1024, L_P2=1,
                   BLOCK_R=8, BLOCK_W=2048, S_P2=64, K_P2=8, R_P2=8, EXPERT_MAJOR=False, POSITION_TOKENS=128, E_P2=1,
                   POSITION_SUB=1), 16),
    (N.PULL, dict(INDEX=False, HAS_SCALES=False, HAS_TOPK=False, BLOCK_R=8, BLOCK_W=2048, S_P2=64, K_P2=8, R_P2=8,
                  EXPERT_MAJOR=False, EVERY_PEER=True, TRACE=False, PIPELINE=False, SIDE_FIRST=False,
                  GATHER_INDEX=False, PUSHED_LISTS=False), 16),
    (N.PULL, dict(INDEX=False, HAS_SCALES=False, HAS_TOPK=False, BLOCK_R=4, BLOCK_W=2048, S_P2=64, K_P2=8, R_P2=8,
                  EXPERT_MAJOR=False, EVERY_PEER=True, TRACE=False, PIPELINE=True, SIDE_FIRST=False, GATHER_INDEX=False,
                  PUSHED_LISTS=False), 16),
    (N.PULL, dict(INDEX=False, HAS_SCALES=False, HAS_TOPK=False, BLOCK_R=8, BLOCK_W=2048, S_P2=64, K_P2=8, R_P2=8,
                  EXPERT_MAJOR=True, EVERY_PEER=True, TRACE=False, PIPELINE=False, SIDE_FIRST=False, GATHER_INDEX=False,
                  PUSHED_LISTS=False), 16),
    (N.PUSH, dict(HAS_WEIGHTS=False, BLOCK_R=8, BLOCK_W=2048, K_P2=8, R_P2=8, EXPERT_MAJOR=False, EVERY_PEER=True,
                  TRACE=False), 16),
    (N.PUSH, dict(HAS_WEIGHTS=False, BLOCK_R=8, BLOCK_W=2048, K_P2=8, R_P2=8, EXPERT_MAJOR=True, EVERY_PEER=True,
                  TRACE=False), 16),
    (N.REDUCE, dict(NUM_BIAS=1, HAS_WEIGHTS=False, R_P2=2, BLOCK_C=8192, K_P2=8, RANK_LOOP=False), 16),
    (N.REDUCE, dict(NUM_BIAS=1, HAS_WEIGHTS=False, R_P2=8, BLOCK_C=2048, K_P2=8, RANK_LOOP=True), 16),
    (N.REDUCE, dict(NUM_BIAS=1, HAS_WEIGHTS=True, R_P2=8, BLOCK_C=8192, K_P2=8, RANK_LOOP=True), 16),
    (L.DISPATCH, dict(SEND=True, RECEIVE=True, USE_FP8=True, ROUND_SCALE=False, UE8M0=False, BLOCK_H=8192, MSGS=8,
                      BLOCK_E=256, HAS_STATS=False, HAS_WAIT_STATS=False, BLOCK_X=1024, BLOCK_S=64, BLOCK_M=4,
                      R_P2=2, REMOTE=0), 8),
    (L.COMBINE, dict(SEND=True, RECEIVE=True, HAS_WAIT_STATS=False, BLOCK_W=2048, K_P2=8, BLOCK_C=1024, R_P2=2,
                     REMOTE=0), 8),
    (L.COMBINE, dict(SEND=False, RECEIVE=True, HAS_WAIT_STATS=False, BLOCK_W=2048, K_P2=8, BLOCK_C=1024, R_P2=8,
                     REMOTE=0), 8),
], ids=lambda v: v.name if hasattr(v, "name") else None)
def test_aligned_copies_use_16_byte_accesses(spec, constexprs, num_warps):
    def wide(counts):  # vector accesses
        return sum(n for width, n in counts.items() if width.startswith(".v"))
    plain = _access_widths(spec, dict(constexprs, ALIGNED=False), num_warps)
    aligned = _access_widths(spec, dict(constexprs, ALIGNED=True), num_warps)
    assert wide(aligned) > wide(plain) and sum(aligned.values()) < sum(plain.values()), (plain, aligned)


def test_messages_and_receive_rows_always_use_16_byte_accesses():
    counts = _access_widths(L.DISPATCH, dict(SEND=False, RECEIVE=True, USE_FP8=True, ROUND_SCALE=False, UE8M0=False,
                                             BLOCK_H=8192, MSGS=8, BLOCK_E=256, HAS_STATS=False, HAS_WAIT_STATS=False,
                                             BLOCK_X=1024, BLOCK_S=64, BLOCK_M=4, R_P2=2, ALIGNED=False,
                                             REMOTE=0), 8)
    assert counts[".v2.b64"] >= 16, counts


def test_nvshmem_kernels_compile_with_the_library_calls_unresolved():
    """Kernels calling NVSHMEM (backends/gpu/reach/nvshmem.py; here the probe's) compile for sm_90 with
    the calls left to the device library that the GPU machine links (ptxas --compile-only)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import nvshmem_probe
    for spec in (nvshmem_probe.PUT, nvshmem_probe.WAIT):
        assert spec.library is not None and spec.library.name == "libnvshmem_device"
        compiled = spec.compile({}, 4, target=GPUTarget("cuda", 90, 32), ptx_options="--compile-only")
        assert compiled.asm["cubin"]
    assert "nvshmemx_putmem_signal_block" in nvshmem_probe.PUT.compile(
        {}, 4, target=GPUTarget("cuda", 90, 32), ptx_options="--compile-only").asm["ptx"]
    ptx = nvshmem_probe.SEND.compile({}, 4, target=GPUTarget("cuda", 90, 32), ptx_options="--compile-only").asm["ptx"]
    for symbol in ("nvshmemx_putmem_nbi_block", "nvshmem_quiet", "nvshmemx_signal_op"):
        assert symbol in ptx, symbol


@pytest.mark.parametrize("fp8,topk,loopback", [(False, False, False), (True, True, False), (False, True, True),
                                                (True, False, True)])
def test_multinode_dispatch_kernels_compile(fp8, topk, loopback):
    """With NVSHMEM (its calls left to the library) and with the loopback transport (no library)."""
    from epcomm.backends.gpu.normal.two_level import dispatch as M
    from epcomm.backends.gpu.normal.two_level import step as S
    target = GPUTarget("cuda", 90, 32)
    options = dict(ptx_options=None if loopback else "--compile-only")
    assert M.NOTIFY.compile(dict(REMOTE=_remote(loopback), R_P2=16, BLOCK_E=128), 4, target=target, **options).asm["cubin"]
    assert M.SEND_LAYOUT.compile(dict(HAS_TOPK=topk, BLOCK_T=128, R_P2=16, N_P2=4, BLOCK_E=256, K_P2=8), 4,
                                 target=target).asm["cubin"]
    for spec in S.STEPS.values():
        assert spec.compile(dict(REMOTE=_remote(loopback), R_P2=16), 4, target=target, **options).asm["cubin"]
    assert S.ABORT.compile(dict(REMOTE=_remote(loopback), R_P2=8), 4, target=target, **options).asm["cubin"]
    meta = dict(HAS_SCALES=fp8, HAS_TOPK=topk, BLOCK_R=8, BLOCK_W=1024, S_P2=64, K_P2=8)
    send = M.SEND.compile(dict(meta, REMOTE=_remote(loopback)), 8, target=target, **options)
    assert ("nvshmemx_putmem_signal_block" in send.asm["ptx"]) != loopback
    # the send split over parts (send_parts > 1): each part's put, its completion, the last one's signal
    for symbol in ("nvshmemx_putmem_nbi_block", "nvshmem_quiet", "nvshmemx_signal_op"):
        assert (symbol in send.asm["ptx"]) != loopback, symbol
    assert M.FORWARD.compile(meta, 8, target=target).asm["cubin"]
    assert M.SEND.library_of(dict(REMOTE=_remote(loopback))) is (None if loopback else NVSHMEM)


@pytest.mark.parametrize("weights,num_bias,loopback", [(False, 0, False), (True, 2, True)])
def test_multinode_combine_kernels_compile(weights, num_bias, loopback):
    from epcomm.backends.gpu.normal.two_level import combine as C
    target = GPUTarget("cuda", 90, 32)
    assert C.PUSH.compile(dict(HAS_WEIGHTS=weights, BLOCK_R=8, BLOCK_W=1024, K_P2=8), 8, target=target).asm["cubin"]
    assert C.REDUCE.compile(dict(HAS_WEIGHTS=weights, NUM_BIAS=num_bias, BLOCK_T=8, BLOCK_C=1024, K_P2=8,
                                 SIGNALS_P2=64), 8, target=target).asm["cubin"]
    forward = C.FORWARD.compile(dict(REMOTE=_remote(loopback), HAS_WEIGHTS=weights, BLOCK_R=8, BLOCK_C=1024, K_P2=8,
                                     LOCAL_P2=8), 8, target=target, ptx_options=None if loopback else "--compile-only")
    assert ("nvshmemx_putmem_signal_block" in forward.asm["ptx"]) != loopback
    for symbol in ("nvshmemx_putmem_nbi_block", "nvshmem_quiet"):  # (send_parts > 1)
        assert (symbol in forward.asm["ptx"]) != loopback, symbol


def test_expert_major_fold_rounds_as_torch_does():
    """The fold kernel is compiled without FMA fusion: each product and sum rounded on its own, as
    torch's expert_major.fold does (bit-for-bit equal results)."""
    ptx = EM.FOLD.compile(dict(BLOCK_R=4, K_P2=8), 4, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "fma.rn.f32" not in ptx and "mul.rn.f32" in ptx


def test_kernel_names_say_which_call_they_belong_to():
    """Profiler tools written for DeepEP count a call's kernels by "dispatch" and
    "combine" in their names (a low-latency call with return_recv_hook launches its kernel twice:
    send and receive phase). Every kernel a dispatch or combine launches names its call, and only
    that one; the compiled kernel carries the name."""
    from epcomm.backends.gpu.normal.two_level import combine as MC
    from epcomm.backends.gpu.normal.two_level import dispatch as MN
    from epcomm.backends.gpu.normal.two_level import step as MS
    calls = {"dispatch": [L.DISPATCH, N.NOTIFY, N.NOTIFY_STAGE, N.STAGE, N.PULL, N.STAGE_PULL, MN.SEND_LAYOUT, MN.NOTIFY, MN.SEND, MN.FORWARD,
                          MS.STEPS["dispatch"], EM.EXPAND],
             "combine": [L.COMBINE, N.PUSH, N.REDUCE, N.PUSH_REDUCE, MC.PUSH, MC.FORWARD, MC.REDUCE, MS.STEPS["combine"], EM.FOLD]}
    for call, specs in calls.items():
        other = "combine" if call == "dispatch" else "dispatch"
        for spec in specs:
            assert call in spec.name and other not in spec.name, spec.name
    compiled = MS.STEPS["combine"].compile(dict(REMOTE=FAR_BY_LOOPBACK, R_P2=2), 4, target=GPUTarget("cuda", 90, 32))
    assert compiled.metadata.name == "ml_combine_step", compiled.metadata.name


def _remote(loopback: bool) -> int:
    """The two-level kernels' REMOTE: the loopback test transport, or NVSHMEM."""
    return FAR_BY_LOOPBACK if loopback else FAR_BY_NVSHMEM


def _multi_node_cases():
    """The nvshmem backend's normal-mode kernels (backends/gpu/normal/two_level), loopback flavour: they
    need no NVSHMEM library, so they compile here too and guard a move of that code."""
    from epcomm.backends.gpu.copy import COPY_WARPS, copy_block_shape
    from epcomm.backends.gpu.normal.two_level import combine as C
    from epcomm.backends.gpu.normal.two_level import dispatch as D
    from epcomm.backends.gpu.normal.two_level import step as S
    for spec in S.STEPS.values():
        yield spec, dict(REMOTE=FAR_BY_LOOPBACK, R_P2=16), 4
    yield S.ABORT, dict(REMOTE=FAR_BY_LOOPBACK, R_P2=8), 4
    yield A.POST_RESYNC, dict(R_P2=8, REMOTE=FAR_BY_LOOPBACK), 1
    yield D.NOTIFY, dict(REMOTE=FAR_BY_LOOPBACK, R_P2=16, BLOCK_E=128), 4
    for topk in (False, True):
        yield D.SEND_LAYOUT, dict(HAS_TOPK=topk, BLOCK_T=128, R_P2=16, N_P2=2, BLOCK_E=256, K_P2=8 if topk else 1), 4
    block_r, block_w = copy_block_shape(7168 * 2 // 8)
    for scales, topk in itertools.product([False, True], repeat=2):
        meta = dict(HAS_SCALES=scales, HAS_TOPK=topk, BLOCK_R=block_r, BLOCK_W=block_w, S_P2=64 if scales else 1,
                    K_P2=8 if topk else 1)
        yield D.SEND, dict(REMOTE=FAR_BY_LOOPBACK, **meta), COPY_WARPS
        yield D.FORWARD, meta, COPY_WARPS
    for weights, num_bias in itertools.product([False, True], [0, 2]):
        k_p2 = 8 if weights else 1
        yield C.PUSH, dict(HAS_WEIGHTS=weights, BLOCK_R=block_r, BLOCK_W=block_w, K_P2=k_p2), COPY_WARPS
        yield C.FORWARD, dict(REMOTE=FAR_BY_LOOPBACK, HAS_WEIGHTS=weights, BLOCK_R=8, BLOCK_C=1024, K_P2=k_p2, LOCAL_P2=8), 8
        yield C.REDUCE, dict(HAS_WEIGHTS=weights, NUM_BIAS=num_bias, BLOCK_T=8, BLOCK_C=1024, K_P2=k_p2,
                             SIGNALS_P2=32), 8


@pytest.mark.parametrize("spec,constexprs,num_warps", list(_multi_node_cases()),
                         ids=lambda v: v.name if hasattr(v, "name") else None)
def test_multi_node_kernels_compile_on_loopback(spec, constexprs, num_warps):
    import re
    compiled = spec.compile(constexprs, num_warps, target=GPUTarget("cuda", 90, 32))
    code = "\n".join(line for line in compiled.asm["ptx"].splitlines() if not line.lstrip().startswith(".file"))
    assert not re.search(r"\bnvshmemx?_\w+", code), "the loopback flavour calls NVSHMEM"


def test_spec_types_come_from_the_annotations():
    """A kernel declares each runtime parameter's type next to it (``x_ptr: "*i8"``); the spec reads
    them (quotes and all, as ``from __future__ import annotations`` leaves them) and names any
    parameter left without one."""
    import triton
    import triton.language as tl
    from epcomm.backends.gpu.launch import KernelSpec
    from epcomm.errors import EPError
    assert [N.STAGE.signature[name] for name in ("x_ptr", "scales_ptr", "scale_stride_t")] == ["*i8", "*fp32", "i64"]

    @triton.jit
    def half_typed(x_ptr: "*i32", n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), n)

    with pytest.raises(EPError, match=r"no type given for \['n'\]"):
        KernelSpec(half_typed)
    assert KernelSpec(half_typed, ["*i32", "i32"]).signature == {"x_ptr": "*i32", "n": "i32", "BLOCK": "constexpr"}


def _sm90_cuobjdump(spec, constexprs, num_warps, option: str) -> str:
    """cuobjdump ``option``'s output for ``spec`` compiled for sm_90 (skips without Triton's cuobjdump)."""
    import os
    import subprocess
    import tempfile
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("Triton's cuobjdump is not installed")
    compiled = spec.compile(constexprs, num_warps, target=GPUTarget("cuda", 90, 32))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([cuobjdump, option, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def _sm90_resource_usage(spec, constexprs, num_warps) -> str:
    """cuobjdump's resource line of ``spec`` compiled for sm_90."""
    return _sm90_cuobjdump(spec, constexprs, num_warps, "--dump-resource-usage")


def test_pipelined_pull_holds_two_half_tiles_without_spilling():
    """The experimental pipelined pull (PIPELINE: the next item's loads before this item's stores)
    keeps two tiles of BLOCK_R / 2 rows where the plain pull keeps one of BLOCK_R: the same 128
    registers and no stack on sm_90 (at the full BLOCK_R it would spill, which the plan avoids)."""
    usage = _sm90_resource_usage(N.PULL, dict(INDEX=False, HAS_SCALES=False, HAS_TOPK=True, ALIGNED=True,
                                              EXPERT_MAJOR=False, EVERY_PEER=True, TRACE=False, PIPELINE=True,
                                              SIDE_FIRST=False, GATHER_INDEX=False, PUSHED_LISTS=False, BLOCK_R=4,
                                              BLOCK_W=2048, S_P2=64, K_P2=8, R_P2=8), 16)
    assert "STACK:0 " in usage and "REG:128 " in usage, usage


# The default pulls at H=7168 (mode.py's plans: BF16 rows in [8, 2048]-word tiles, FP8 in [16, 1024]).
_PULL = dict(EVERY_PEER=True, TRACE=False, ALIGNED=True, K_P2=8, R_P2=8, PUSHED_LISTS=False)
_ONE_LAUNCH = dict(_PULL, LIST_BLOCK=1024, OUT_ALIGNED=True, DOORBELL=False, NOTIFY=False, NOTIFY_BLOCK=256)


@pytest.mark.parametrize("spec,constexprs", [
    (N.PULL, dict(_PULL, EXPERT_MAJOR=False, PIPELINE=False, GATHER_INDEX=False, INDEX=True, HAS_SCALES=False,
                  HAS_TOPK=True, BLOCK_R=8, BLOCK_W=2048, S_P2=1)),
    (N.PULL, dict(_PULL, EXPERT_MAJOR=False, PIPELINE=False, GATHER_INDEX=False, INDEX=True, HAS_SCALES=True,
                  HAS_TOPK=True, BLOCK_R=16, BLOCK_W=1024, S_P2=64)),
    (N.STAGE_PULL, dict(_ONE_LAUNCH, INDEX=False, WRITE_LISTS=False, HAS_SCALES=True, HAS_TOPK=False, L_P2=1,
                        BLOCK_R=16, BLOCK_W=1024, S_P2=64)),
    (N.STAGE_PULL, dict(_ONE_LAUNCH, INDEX=True, WRITE_LISTS=True, HAS_SCALES=False, HAS_TOPK=True, L_P2=128,
                        BLOCK_R=8, BLOCK_W=2048, S_P2=1)),
], ids=["full", "full-fp8", "cached-fp8-one-launch", "full-one-launch"])
def test_loading_side_rows_first_costs_no_more_stack_than_after(spec, constexprs):
    """SIDE_FIRST (the default since 2026-11-28) keeps an item's scales and top-k rows in registers
    while its x rows load: on sm_90 it needs no more stack than loading them after (the FP8 tiles
    used 96-144 bytes of stack either way when it became the default; BF16's in-turn pull none)."""
    def stack(side_first):
        usage = _sm90_resource_usage(spec, dict(constexprs, SIDE_FIRST=side_first), 16)
        return int(usage.split("STACK:")[1].split()[0])
    assert stack(True) <= stack(False)
    if spec is N.PULL and not constexprs["HAS_SCALES"]:
        assert stack(True) == 0


def _sm90_local_loads(spec, constexprs, num_warps) -> int:
    """Local-memory loads (spilled registers read back: ``LDL``) in ``spec``'s sm_90 code."""
    return sum(" LDL" in line for line in _sm90_cuobjdump(spec, constexprs, num_warps, "-sass").splitlines())


@pytest.mark.parametrize("tiles", [dict(HAS_SCALES=False, BLOCK_R=8, BLOCK_W=2048, S_P2=1),
                                   dict(HAS_SCALES=True, BLOCK_R=16, BLOCK_W=1024, S_P2=64)], ids=["bf16", "fp8"])
def test_the_count_exchange_in_ep_dispatch_leaves_the_pull_its_registers(tiles):
    """ep_dispatch with NOTIFY (a num_worst_tokens dispatch in one launch) at H=7168: about as few
    spilled registers as without (2026-11-29g: 8 against 6 local loads in the whole code, the
    called count exchange included, in BF16; 75 against 70 in FP8). Inlined, the count exchange
    and poll_epochs' wait for NOTIFIED took the 16-warp program's registers (128 a thread): 65
    local loads against 6 in BF16, 15-33 of them in the pull's item loop against 5. So _notify
    is a called function and the wait a lean loop."""
    constexprs = dict(_ONE_LAUNCH, INDEX=True, WRITE_LISTS=True, HAS_TOPK=True, L_P2=32, SIDE_FIRST=True,
                      PUSHED_LISTS=True, **tiles)
    apart = _sm90_local_loads(N.STAGE_PULL, dict(constexprs, NOTIFY=False), 16)
    assert _sm90_local_loads(N.STAGE_PULL, dict(constexprs, NOTIFY=True), 16) <= apart + 8


@pytest.mark.parametrize("kernel", ["notify and stage", "notify and stage, expert-major",
                                    "num_worst_tokens: notify, stage and pull"])
def test_the_single_launch_releases_its_stage_after_the_count_rows_are_read(kernel):
    """ep_dispatch_notify_stage's last notify program releases NOTIFIED to the stage programs (the
    kernel's one gpu-scope exchange) right after a CTA barrier, and loads nothing between that
    release and the mailbox's system-scope release: every read of this rank's count rows comes
    first. Once the stage signals, a peer's next count exchange may write those rows again
    (notify.py); released before the reads (the first form of 2026-11-29b), they could be read torn.
    The same for ep_dispatch with NOTIFY (a num_worst_tokens dispatch in one launch), whose pull
    programs also wait for NOTIFIED before they read rank_prefix_matrix."""
    import re
    target = GPUTarget("cuda", 90, 32)
    if kernel.startswith("num_worst_tokens"):
        ptx = N.STAGE_PULL.compile(dict(_ONE_LAUNCH, INDEX=True, WRITE_LISTS=True, HAS_SCALES=False, HAS_TOPK=True,
                                        L_P2=128, BLOCK_R=8, BLOCK_W=2048, S_P2=1, SIDE_FIRST=True, NOTIFY=True,
                                        PUSHED_LISTS=True), 16, target=target).asm["ptx"]
    else:
        ptx = N.NOTIFY_STAGE.compile(dict(HAS_SCALES=False, HAS_TOPK=True, WRITE_LISTS=True, LIST_BLOCK=1024,
                                          L_P2=128, PUSHED_LISTS=True, ALIGNED=True,
                                          EXPERT_MAJOR=kernel.endswith("expert-major"), POSITION_TOKENS=128, E_P2=256,
                                          POSITION_SUB=16, BLOCK=256, BLOCK_R=8, BLOCK_W=2048, S_P2=64, K_P2=8,
                                          R_P2=8), 16, target=target).asm["ptx"]
    code = [line.strip() for line in ptx.splitlines()]
    memory = [re.sub(r"^@%p\d+\s+", "", line) for line in code
              if re.match(r"^(@%p\d+\s+)?(ld|st|atom|red|bar|fence|membar)\.", line)]
    (release,) = [i for i, line in enumerate(memory) if line.startswith("atom.global.gpu.release.exch")]
    assert memory[release - 1].startswith("bar.sync"), memory[release - 3:release + 1]
    mailbox = next(i for i in range(release, len(memory)) if memory[i].startswith("st.release.sys"))
    assert not [line for line in memory[release:mailbox] if line.startswith("ld.")], memory[release:mailbox + 1]
