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


# ------------------------------------------------------------------ normal dispatch's scale formats
def _scales_in(layout: str, words: torch.Tensor) -> torch.Tensor:
    """The int32 words ``[T, S]`` laid out as an engine passes them."""
    T, S = words.shape
    if layout == "row-major":
        return words.clone()
    if layout == "column-major":
        return words.t().contiguous().t()
    storage = torch.zeros(S, (T + 3) // 4 * 4, dtype=torch.int32)  # DeepGEMM's TMA-aligned column-major
    storage[:, :T] = words.t()
    scales = storage.t()[:T]
    assert T == 0 or scales.stride() == (1, (T + 3) // 4 * 4)
    return scales


@pytest.mark.parametrize("layout", ["row-major", "column-major", "tma-aligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
@pytest.mark.parametrize("width", [1, 2, 4, 5, 9, 40])
@pytest.mark.parametrize("tokens", [0, 1, 7])
def test_dispatch_payload_carries_any_scale_format_bit_exactly(layout, dtype, width, tokens):
    """Whatever the scales' dtype (4 bytes), width and strides, the wire form is float32 words
    [T', H'/128] (what the backends copy) and restore gives back the values and the scales' exact
    bits, row-major, in the caller's dtype and width; NaN bit patterns (UE8M0 bytes 0xFF) survive."""
    hidden = 512
    values = torch.randn(tokens, hidden).to(torch.float8_e4m3fn)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (tokens, width), dtype=torch.int32)
    if tokens:
        words[0, 0] = 0x7F808080  # a signalling-NaN pattern as float32
    scales = _scales_in(layout, words).view(dtype)
    payload = fp8.DispatchPayload("x", (values, scales), torch.device("cpu"))
    wire_values, wire_scales = payload.x
    assert payload.is_fp8 and (payload.num_tokens, payload.hidden) == (tokens, hidden)
    assert wire_values.dtype == torch.float8_e4m3fn and wire_values.is_contiguous()
    assert wire_scales.dtype == torch.float32 and wire_scales.shape == (tokens, wire_values.shape[1] // 128)
    if width <= hidden // 128:
        assert wire_values.shape[1] == hidden  # only a width above H/128 widens the values
    received = (wire_values.clone(), wire_scales.contiguous().clone())  # a backend copies rows
    got_values, got_scales = payload.restore(received)
    assert torch.equal(got_values.view(torch.uint8), values.view(torch.uint8))
    assert got_scales.dtype == dtype and got_scales.shape == (tokens, width) and got_scales.is_contiguous()
    assert torch.equal(got_scales.view(torch.int32), words)


def test_dispatch_payload_passes_hidden_over_128_scales_as_they_are():
    """float32 [T, H/128] in any strides (and int32 of that width, as a view) cost no copy."""
    values = torch.randn(6, 256).to(torch.float8_e4m3fn)
    scales = _scales_in("tma-aligned", torch.randint(0, 100, (6, 2), dtype=torch.int32)).view(torch.float32)
    payload = fp8.DispatchPayload("x", (values, scales), torch.device("cpu"))
    assert payload.x[0] is values and payload.x[1] is scales
    as_int = fp8.DispatchPayload("x", (values, scales.view(torch.int32)), torch.device("cpu"))
    assert as_int.x[1].data_ptr() == scales.data_ptr()
    bf16 = torch.randn(6, 256).to(torch.bfloat16)
    plain = fp8.DispatchPayload("x", bf16, torch.device("cpu"))
    assert not plain.is_fp8 and plain.x is bf16 and plain.restore(bf16) is bf16


def test_a_plain_pair_is_float32_scales_of_the_slots_width_in_any_strides():
    """fp8.plain_pair: the pairs whose payload's wire is the pair itself (Buffer.dispatch makes no
    payload for them once their shapes passed)."""
    from epcomm import checks
    values = torch.randn(6, 512).to(torch.float8_e4m3fn)
    words = torch.randint(0, 100, (6, 4), dtype=torch.int32)
    for layout in ("row-major", "column-major", "tma-aligned"):
        scales = _scales_in(layout, words).view(torch.float32)
        assert fp8.plain_pair(checks.fp8_pair_key((values, scales)))
        payload = fp8.DispatchPayload("x", (values, scales), torch.device("cpu"))
        restored = payload.restore(payload.x)
        assert payload.x[0] is values and payload.x[1] is scales and restored[0] is values and restored[1] is scales
    assert not fp8.plain_pair(checks.fp8_pair_key((values, words)))  # int32: viewed, restored as int32
    assert not fp8.plain_pair(checks.fp8_pair_key((values, torch.zeros(6, 1))))  # UE8M0's width: padded
    assert not fp8.plain_pair(checks.fp8_pair_key((values, torch.zeros(6, 5))))  # wider: carried in the values


@pytest.mark.parametrize("bad, argument", [
    ((torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.float64)), "x[1]"),
    ((torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.int16)), "x[1]"),
    ((torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.zeros(3, 2)), "x[1]"),
    ((torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.zeros(4)), "x[1]"),
    ((torch.zeros(4, 256).to(torch.float8_e4m3fn), torch.zeros(4, 0)), "x[1]"),
    ((torch.zeros(4, 200).to(torch.float8_e4m3fn), torch.zeros(4, 2)), "x[0]"),
    ((torch.zeros(4, 256), torch.zeros(4, 2)), "x[0]"),
    ((torch.zeros(4, 256).to(torch.float8_e4m3fn),), "x"),
])
def test_dispatch_payload_names_what_it_refuses(bad, argument):
    from epcomm.errors import EPInputError
    with pytest.raises(EPInputError) as info:
        fp8.DispatchPayload("x", bad, torch.device("cpu"))
    assert info.value.argument == argument


# ------------------------------------------------------------------ NVFP4 (low-latency dispatch)
@pytest.mark.parametrize("seed", range(4))
def test_nvfp4_round_trip_within_bound(seed):
    from epcomm import nvfp4
    x = _inputs(seed, tokens=33, hidden=512).to(torch.bfloat16)
    # the usual global scale (448 * 6 / amax, no block scale saturates), and smaller ones
    g = torch.tensor([448 * 6 / x.float().abs().max().item()]) * (4.0 ** -seed)
    packed, scales = nvfp4.quantize(x, g)
    assert packed.dtype == torch.uint8 and packed.shape == (33, 256)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (33, 32)
    back = nvfp4.dequantize(packed, scales, g)
    assert torch.isfinite(back).all() and (back[0] == 0).all()
    assert ((back - x.float()).abs() <= nvfp4.error_bound(x, scales, g)).all()


def test_nvfp4_codes_round_to_nearest_ties_to_even_and_saturate():
    from epcomm import nvfp4
    v = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 9.0, -0.75, -9.0])
    assert nvfp4._e2m1_codes(v).tolist() == [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 8 | 2, 8 | 7]
    # the packing: element 2i in the low nibble; a block of 16 equal values has scale amax/6*g
    packed, scales = nvfp4.quantize(torch.tensor([[6.0, -3.0] * 8]), torch.ones(1))
    assert scales.float().tolist() == [[1.0]] and packed.tolist() == [[0x7 | (0xD << 4)] * 8]


def test_nvfp4_swizzle_is_the_128x4_atom_layout():
    """Scale (row m, block k) of expert l sits at [m % 32, (m % 128) // 32, m // 128, k % 4, k // 4, l]
    of the [32, 4, rm, 4, rk, L] view, whose storage is contiguous [L, rm, rk, 32, 4, 4]."""
    from epcomm import nvfp4
    scales = torch.randint(0, 255, (3, 200, 36), dtype=torch.uint8)
    swizzled = nvfp4.swizzle_scales(scales)
    assert swizzled.shape == (32, 4, 2, 4, 9, 3) and swizzled.permute(5, 2, 4, 0, 1, 3).is_contiguous()
    for l, m, k in ((0, 0, 0), (1, 37, 5), (2, 199, 35), (1, 128, 4), (0, 95, 3)):
        assert swizzled[m % 32, (m % 128) // 32, m // 128, k % 4, k // 4, l] == scales[l, m, k]
    assert torch.equal(nvfp4.unswizzle_scales(swizzled, 200, 36), scales)
    assert nvfp4.unswizzle_scales(swizzled, 256, 36)[:, 200:].eq(0).all()  # padding rows
