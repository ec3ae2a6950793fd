"""The per-engine cases (vllm_cases.py, sglang_cases.py, megatron_cases.py) on CUDA GPUs, one rank per
GPU (on a machine of one GPU: one rank, its own peer): the nvlink backend carries every FP8 scale
format (as float32 words its kernels only copy) and the NVFP4 low-latency payload. Skipped without CUDA."""
import pytest
import torch

import megatron_cases
import sglang_cases
import vllm_cases
from epcomm.testing import WorkerPool

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs CUDA GPUs")]


@pytest.fixture(scope="module", params=sorted({min(GPUS, 4), min(GPUS, 2)}) if GPUS else [1])
def gpu_pool(request):
    pool = WorkerPool(request.param, backend="nccl")
    yield pool
    pool.close()


@pytest.mark.parametrize("form", ["vllm_block", "vllm_per_token", "vllm_mxfp8"])
def test_vllm_high_throughput_scale_formats_on_gpu(gpu_pool, form):
    results = gpu_pool.run(vllm_cases.high_throughput, form, timeout_s=600)
    assert len(set(results)) == 1 and results[0] is not None


def test_vllm_low_latency_nvfp4_and_fp8_on_gpu(gpu_pool):
    assert all(gpu_pool.run(vllm_cases.low_latency, timeout_s=600))


@pytest.mark.parametrize("form", ["sglang_blackwell", "sglang_hopper_column_major"])
def test_sglang_dispatchers_on_gpu(gpu_pool, form):
    results = gpu_pool.run(sglang_cases.dispatchers, form, timeout_s=600)
    assert len(set(results)) == 1 and results[0] is not None


@pytest.mark.parametrize("async_finish", [False, True])
def test_megatron_fused_all_to_all_on_gpu(gpu_pool, async_finish):
    assert all(gpu_pool.run(megatron_cases.fused_layer, async_finish, timeout_s=600))
