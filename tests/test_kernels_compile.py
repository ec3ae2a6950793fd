"""Every nvlink kernel specialisation the hot paths use compiles for sm_90 (no GPU needed: Triton
compiles for a named target). Skipped where Triton is not installed (CI installs only torch)."""
import itertools

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402

from epcomm.backends.nvlink import low_latency as L  # noqa: E402
from epcomm.backends.nvlink import normal as N  # noqa: E402
from epcomm.backends.nvlink import sync as S  # noqa: E402


def _cases():
    yield S._probe_kernel, {}, 1
    yield N.LAYOUT, dict(BLOCK_T=128, E_P2=256, K_P2=8, R_P2=8, SUM_ROWS=32), 4
    yield N.NOTIFY, dict(R_P2=8, BLOCK=256), 4
    copy = dict(BLOCK_R=8, BLOCK_W=2048, S_P2=64, K_P2=8, R_P2=8)
    for fp8, topk, lists in itertools.product([False, True], repeat=3):
        yield N.STAGE, dict(HAS_SCALES=fp8, HAS_TOPK=topk, WRITE_LISTS=lists, LIST_BLOCK=1024, **copy), 16
        yield N.PULL, dict(INDEX=lists, HAS_SCALES=fp8, HAS_TOPK=topk, **copy), 16
    for weights, num_bias in itertools.product([False, True], [0, 1, 2]):
        yield N.PUSH, dict(HAS_WEIGHTS=weights, BLOCK_R=8, BLOCK_W=2048, K_P2=8, R_P2=8), 16
        yield N.REDUCE, dict(NUM_BIAS=num_bias, HAS_WEIGHTS=weights, R_P2=8, BLOCK_C=2048, K_P2=8), 16
    for fp8, round_scale, ue8m0 in [(True, False, False), (True, True, False), (True, True, True), (False, False, False)]:
        yield L.SEND, dict(USE_FP8=fp8, ROUND_SCALE=round_scale, UE8M0=ue8m0, BLOCK_H=8192, MSGS=8, BLOCK_E=256), 8
        yield L.SEND, dict(USE_FP8=fp8, ROUND_SCALE=round_scale, UE8M0=ue8m0, BLOCK_H=8192, MSGS=4, BLOCK_E=256), 8
    for stats, wait_stats in itertools.product([False, True], repeat=2):
        yield L.RECV, dict(HAS_STATS=stats, HAS_WAIT_STATS=wait_stats, BLOCK_X=1024, BLOCK_S=64, BLOCK_M=4, R_P2=8), 8
        yield L.COMBINE_RECV, dict(HAS_WAIT_STATS=wait_stats, K_P2=8, BLOCK_C=1024, R_P2=8), 8
    yield L.COMBINE_SEND, dict(BLOCK_W=2048, R_P2=8), 8


@pytest.mark.parametrize("spec,constexprs,num_warps", list(_cases()),
                         ids=lambda v: v.name if hasattr(v, "name") else None)
def test_kernel_compiles_for_sm90(spec, constexprs, num_warps):
    compiled = spec.compile(constexprs, num_warps, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]


def test_spec_rejects_wrong_type_count():
    from epcomm.backends.nvlink.launch import KernelSpec
    from epcomm.errors import EPError
    with pytest.raises(EPError, match="runtime parameters"):
        KernelSpec(N.ep_dispatch_layout, ["*i64"])
