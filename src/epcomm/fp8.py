"""FP8 (e4m3) casts with one float32 scale per token and 128-channel group, and UE8M0 packing.

Error bound (tested): for every element, ``|cast_back(cast(x)) - x| <= |x| / 16 + scale / 512``
where ``scale`` is the element's group scale: e4m3 keeps 3 mantissa bits (relative rounding
<= 2**-4) and its subnormal step is ``2**-9`` of the scale. Power-of-two (``round_scale``) scales
only make the scale up to 2x larger, which the same bound covers.
"""
from __future__ import annotations

from typing import Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
# Groups whose amax is below this get this scale instead, so all-zero groups do not divide by 0.
_MIN_AMAX = 1e-4


def _check_hidden(hidden: int) -> None:
    if hidden % GROUP:
        raise ValueError(f"hidden size {hidden} is not a multiple of {GROUP}")


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x [T, H]`` (bf16/float) to ``(x_fp8 [T, H] e4m3, scales [T, H/128] float32)``.

    ``x ≈ x_fp8 * scales`` group-wise. ``round_scale=True`` rounds each scale up to a power of two
    (as needed for UE8M0).
    """
    num_tokens, hidden = x.shape
    _check_hidden(hidden)
    groups = x.float().view(num_tokens, hidden // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp_min(_MIN_AMAX)
    scales = amax / FP8_MAX
    if round_scale:
        scales = round_up_to_power_of_two(scales)
    x_fp8 = (groups / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8.view(num_tokens, hidden), scales.contiguous()


def round_up_to_power_of_two(scales: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= each positive float32 scale, computed exactly on the bits
    (a float log2 can round a value just above 2**n down to n)."""
    bits = scales.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`per_token_cast_to_fp8`: ``[..., H]`` e4m3 and ``[..., H/128]`` scales → ``dtype``.

    ``scales`` may be float32 or UE8M0-packed int32 (``[..., H/512]``).
    """
    hidden = x_fp8.shape[-1]
    _check_hidden(hidden)
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    groups = x_fp8.float().reshape(*x_fp8.shape[:-1], hidden // GROUP, GROUP)
    return (groups * scales.float().unsqueeze(-1)).reshape(x_fp8.shape).to(dtype)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[..., G]`` → int32 ``[..., G/4]``, 4 exponent bytes per word.

    Byte ``i`` (little-endian) of word ``w`` holds the biased exponent of scale ``4w + i``.
    """
    if scales.shape[-1] % 4:
        raise ValueError(f"UE8M0 packing needs a multiple of 4 scale groups, got {scales.shape[-1]}")
    exponent = (scales.float().contiguous().view(torch.int32) >> 23) & 0xFF
    exponent = exponent.reshape(*scales.shape[:-1], scales.shape[-1] // 4, 4)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=scales.device)
    return (exponent << shifts).sum(-1, dtype=torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., G/4]`` → float32 power-of-two scales ``[..., G]`` (inverse of :func:`pack_ue8m0`)."""
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=packed.device)
    exponent = (packed.unsqueeze(-1) >> shifts) & 0xFF
    return (exponent << 23).view(torch.float32).reshape(*packed.shape[:-1], packed.shape[-1] * 4)


def fp8_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The documented per-element error bound of a cast round trip (for tests)."""
    num_tokens, hidden = x.shape
    per_element_scale = scales.float().repeat_interleave(GROUP, dim=-1)
    return x.float().abs() / 16 + per_element_scale / 512
