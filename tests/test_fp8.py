"""FP8 casts: the documented error bound, power-of-two scales, UE8M0 packing."""
import pytest
import torch

from epcomm import fp8


def _inputs(seed, tokens=33, hidden=512):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(tokens, 1, generator=g) * 100
    x = torch.randn(tokens, hidden, generator=g) * scale
    x[0] = 0  # an all-zero token must not divide by zero
    x[1, :128] = 1e-6  # a tiny group exercises subnormals
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_round_trip_within_bound(dtype, round_scale, seed):
    x = _inputs(seed).to(dtype)
    values, scales = fp8.per_token_cast_to_fp8(x, round_scale=round_scale)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (x.shape[0], x.shape[1] // 128)
    back = fp8.per_token_cast_back(values, scales, torch.float32)
    error = (back - x.float()).abs()
    assert torch.isfinite(back).all()
    assert (error <= fp8.fp8_bound(x, scales)).all()
    assert (back[0] == 0).all()


def test_values_fit_e4m3_range():
    x = _inputs(0)
    values, _ = fp8.per_token_cast_to_fp8(x)
    assert values.float().abs().max() <= fp8.FP8_MAX


def test_round_scale_gives_powers_of_two():
    _, scales = fp8.per_token_cast_to_fp8(_inputs(1), round_scale=True)
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all()


def test_ue8m0_pack_unpack():
    _, scales = fp8.per_token_cast_to_fp8(_inputs(2), round_scale=True)
    packed = fp8.pack_ue8m0(scales)
    assert packed.dtype == torch.int32 and packed.shape == (scales.shape[0], scales.shape[1] // 4)
    assert torch.equal(fp8.unpack_ue8m0(packed), scales)
    # cast-back accepts packed scales directly
    values, _ = fp8.per_token_cast_to_fp8(_inputs(2), round_scale=True)
    assert torch.equal(fp8.per_token_cast_back(values, packed), fp8.per_token_cast_back(values, scales))


def test_ue8m0_byte_order():
    scales = torch.tensor([[1.0, 2.0, 0.5, 4.0]])
    word = int(fp8.pack_ue8m0(scales)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (8 * i)) & 0xFF for i in range(4)] == [127, 128, 126, 129]


def test_hidden_must_be_multiple_of_128():
    with pytest.raises(ValueError):
        fp8.per_token_cast_to_fp8(torch.randn(2, 100))
    with pytest.raises(ValueError):
        fp8.pack_ue8m0(torch.ones(2, 3))
