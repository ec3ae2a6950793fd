"""NVFP4 (e2m1 values, e4m3 scale per 16 values, one float32 global scale) for low-latency dispatch.

``Buffer.low_latency_dispatch(..., use_nvfp4=True, x_global_scale=g)`` returns what DeepEP's NVFP4
dispatch returns (the layout SGLang and vLLM hand to FlashInfer's CuTe DSL grouped GEMM as it is):

- values ``uint8 [R*M, H/2, E_local]`` (a permuted view of contiguous ``[E_local, R*M, H/2]``), two
  e2m1 codes per byte, element ``2i`` in the low nibble;
- block scales ``float8_e4m3fn [32, 4, ceil(R*M/128), 4, ceil(H/64), E_local]``, the 128x4 swizzled
  layout (a permuted view of contiguous ``[E_local, rm, rk, 32, 4, 4]``): the scale of row ``m``
  and 16-value block ``k`` of expert ``l`` is at ``[m % 32, (m % 128) // 32, m // 128, k % 4, k // 4, l]``;
  padding rows and blocks are 0.

A value is ``e2m1 * scale / g``: each 16-value block's scale is ``amax / 6 * g`` rounded to e4m3
(saturated at 448), each value ``x * g / scale`` rounded to the nearest e2m1 (ties to even),
saturated at 6. Error bound (tested), for ``g <= 448 * 6 / amax|x|`` (the usual global scale: no
block scale saturates), per element: ``|dequantize(quantize(x)) - x| <= |x| / 4 + scale / (4 g) +
6 * 2**-9 / g`` — e2m1 keeps one mantissa bit (half a step is at most a quarter of the value above
0.5, 0.25 below), and a scale rounded down in e4m3's subnormal range (steps of 2**-9) clips at
most ``6 * 2**-9 / g``.

The quantization is this module's torch code, run on the sending rank before the exchange; the
bytes travel as a bf16 payload of ``H' = roundup(9H/32, 128)`` columns (values then scales), which
every backend's low-latency path carries as it carries bf16 tokens (``H' <= H``: it fits the
buffer sized for ``H``), and :class:`Wire` lays the received bytes out as above.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .errors import EPInputError

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 values (already divided by their scale) → e2m1 codes uint8 (bit 3 the sign), the
    nearest magnitude, ties to the even code, saturated at 6."""
    mag = v.abs().clamp_max(E2M1_MAX)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=v.device)
    code = (mag.unsqueeze(-1) > mids).sum(-1, dtype=torch.int32)
    tie = (mag == mids[code.clamp_max(len(_MIDPOINTS) - 1)]) & (code % 2 == 1) & (code < len(_MIDPOINTS))
    code = code + tie.to(torch.int32)
    return (code | ((v < 0).to(torch.int32) << 3)).to(torch.uint8)


def quantize(x: torch.Tensor, global_scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The reference quantizer: ``x [T, H]`` (bf16/float, ``H % 16 == 0``) and a float32 global
    scale (one value) → ``(packed uint8 [T, H/2], scales float8_e4m3fn [T, H/16])``, row-major."""
    T, H = x.shape
    if H % BLOCK:
        raise ValueError(f"hidden size {H} is not a multiple of {BLOCK}")
    g = global_scale.reshape(-1)[:1].float()
    blocks = x.float().view(T, H // BLOCK, BLOCK)
    scale = (blocks.abs().amax(-1) / E2M1_MAX * g).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)
    s = scale.float().unsqueeze(-1)
    v = torch.where(s > 0, blocks * g / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(blocks))
    codes = _e2m1_codes(v).view(T, H // 2, 2)
    return codes[..., 0] | (codes[..., 1] << 4), scale


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """``packed uint8 [..., H/2]``, ``scales float8_e4m3fn [..., H/16]`` (row-major) → float32 ``[..., H]``."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    values = table[codes.long()]
    per_value = scales.float().repeat_interleave(BLOCK, dim=-1)
    return values * per_value / global_scale.reshape(-1)[:1].float()


def error_bound(x: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The module docstring's per-element bound of a round trip (for tests)."""
    g = global_scale.reshape(-1)[:1].float()
    per_value = scales.float().repeat_interleave(BLOCK, dim=-1) / g
    return x.float().abs() / 4 + per_value / 4 + 6 * 2.0 ** -9 / g


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Per-expert row-major scales ``[L, rows, H/16]`` (any float8/uint8 bytes) → DeepEP's layout
    ``[32, 4, ceil(rows/128), 4, ceil(H/64), L]`` (a view of contiguous ``[L, rm, rk, 32, 4, 4]``)."""
    L, rows, k = scales.shape
    rm, rk = -(-rows // 128), -(-k // 4)
    padded = torch.zeros(L, rm * 128, rk * 4, dtype=torch.uint8, device=scales.device)
    padded[:, :rows, :k] = scales.view(torch.uint8)
    atoms = padded.view(L, rm, 4, 32, rk, 4).permute(0, 1, 4, 3, 2, 5).contiguous()  # [L, rm, rk, 32, 4, 4]
    return atoms.view(scales.dtype if scales.dtype != torch.uint8 else torch.uint8).permute(3, 4, 1, 5, 2, 0)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: ``[32, 4, rm, 4, rk, L]`` → ``[L, rows, k]``."""
    atoms = swizzled.permute(5, 2, 4, 0, 1, 3)  # [L, rm, rk, 32, 4, 4]
    L, rm, rk = atoms.shape[:3]
    return atoms.permute(0, 1, 4, 3, 2, 5).reshape(L, rm * 128, rk * 4)[:, :rows, :k]


def wire_hidden(hidden: int) -> int:
    """bf16 columns of the payload carrying one token's NVFP4 bytes (``H/2 + H/16``), rounded up to 128."""
    return -(-(hidden // 2 + hidden // BLOCK) // 256) * 128


class Wire:
    """One NVFP4 low-latency dispatch: the quantized tokens as a bf16 payload (:attr:`x`) for the
    backend's bf16 path, and :meth:`unpack` of what it received.

    Args:
        x: bf16 ``[T, H]`` (``H % 128 == 0``, validated by the caller).
        x_global_scale: float32 tensor of one value (or several equal ones, as SGLang passes one
            per local expert) on ``x``'s device; EPInputError naming it otherwise. Its first value
            is used (read on the device: no host synchronisation unless ``check_values``).
    """

    def __init__(self, x: torch.Tensor, x_global_scale, check_values: bool):
        if not isinstance(x_global_scale, torch.Tensor) or x_global_scale.dtype != torch.float32 or \
                x_global_scale.numel() < 1 or x_global_scale.device != x.device:
            raise EPInputError("x_global_scale", f"must be a float32 tensor of one value on {x.device} with "
                                                 f"use_nvfp4=True, got {_describe(x_global_scale)}")
        flat = x_global_scale.reshape(-1)
        if check_values and not (bool((flat == flat[0]).all()) and bool(torch.isfinite(flat[0])) and
                                 float(flat[0]) > 0):
            raise EPInputError("x_global_scale", f"must be one positive finite value, got {flat.tolist()[:8]}")
        T, H = x.shape
        self.hidden, self.global_scale = H, flat[:1]
        packed, scales = quantize(x, self.global_scale)
        wire = torch.zeros(T, 2 * wire_hidden(H), dtype=torch.uint8, device=x.device)
        wire[:, :H // 2] = packed
        wire[:, H // 2:H // 2 + H // BLOCK] = scales.view(torch.uint8)
        self.x = wire.view(torch.bfloat16)

    def unpack(self, recv_x: torch.Tensor, handle, hook: Optional[Callable[[], None]]):
        """The backend's bf16 ``[E_local, R*M, H']`` rows → ``((values, scales), handle, hook)`` in
        DeepEP's NVFP4 layout (module docstring); the handle gets the caller's ``hidden`` back
        (low_latency_combine takes bf16 ``[E_local, R*M, H]``). With a hook the outputs are made
        now and filled when the returned hook runs (after the backend's)."""
        L, rows, _ = recv_x.shape
        H = self.hidden
        values = torch.empty(L, rows, H // 2, dtype=torch.uint8, device=recv_x.device)
        atoms = torch.zeros(L, -(-rows // 128), -(-(H // BLOCK) // 4), 32, 4, 4, dtype=torch.uint8,
                            device=recv_x.device)
        out = (values.permute(1, 2, 0), atoms.view(torch.float8_e4m3fn).permute(3, 4, 1, 5, 2, 0))

        def fill() -> None:
            wire = recv_x.view(torch.uint8)
            values.copy_(wire[..., :H // 2])
            atoms.copy_(swizzle_scales(wire[..., H // 2:H // 2 + H // BLOCK]).permute(5, 2, 4, 0, 1, 3))

        if hook is None:
            fill()
            return out, handle._replace(hidden=H), None

        def receive() -> None:
            hook()
            fill()
        return out, handle._replace(hidden=H), receive


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')} {list(value.shape)} on {value.device}"
    return type(value).__name__


def wire_for(x: torch.Tensor, use_nvfp4: bool, x_global_scale, check_values: bool) -> Optional[Wire]:
    """The :class:`Wire` of a low-latency dispatch with ``use_nvfp4``, else None; a global scale
    without ``use_nvfp4`` is an EPInputError naming ``x_global_scale``."""
    if not use_nvfp4:
        if x_global_scale is not None:
            raise EPInputError("x_global_scale", "is the NVFP4 global scale: it needs use_nvfp4=True")
        return None
    return Wire(x, x_global_scale, check_values)
