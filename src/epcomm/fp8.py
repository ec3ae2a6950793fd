"""FP8 (e4m3) casts with one float32 scale per token and 128-channel group, and UE8M0 packing.

Error bound (tested): for every element, ``|cast_back(cast(x)) - x| <= |x| / 16 + scale / 512``
where ``scale`` is the element's group scale: e4m3 keeps 3 mantissa bits (relative rounding
<= 2**-4) and its subnormal step is ``2**-9`` of the scale. Power-of-two (``round_scale``) scales
only make the scale up to 2x larger, which the same bound covers.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .checks import check_tensor
from .errors import EPInputError

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


# ---------------------------------------------------------------------- normal dispatch's FP8 payload
SCALE_DTYPES = (torch.float32, torch.int32)


class DispatchPayload:
    """A normal dispatch's ``x`` as every backend carries it, and the way back to the caller's format.

    DeepEP treats an FP8 input's scales as an opaque per-token payload of 4-byte words: float32 or
    int32, any width ``S`` and any strides (row-major, column-major, the TMA-aligned column-major
    ``(1, round_up(T, 4))`` of DeepGEMM, UE8M0 packed 4 per int32), and returns the received scales
    in the same dtype and width, row-major ``[num_recv_rows, S]``. The backends move scales as
    float32 words ``[T, H/128]``, which they only copy; this class puts any format into that slot
    (bits kept: int32 words are viewed as float32, never converted) and :meth:`restore` takes it
    out again:

    - ``S == H/128``: the caller's scales themselves (an int32 view as float32; strides kept);
    - ``S < H/128``: the words, zero-padded to ``H/128`` (one small copy);
    - ``S > H/128``: the values get ``128 * j`` extra bytes per row, which carry the words the
      slot has no room for (a copy of the values: the one costly case; no engine sends it).

    Attributes: ``num_tokens``, ``hidden`` (the caller's ``T``, ``H``), ``is_fp8``, ``x`` (what
    the backend gets: the bf16 tensor, or the wire pair), ``tensors`` (the caller's and the wire's
    tensors, for the stream bookkeeping of an asynchronous call).
    """

    __slots__ = ("num_tokens", "hidden", "is_fp8", "x", "tensors", "_dtype", "_width")

    def __init__(self, name: str, x, device: torch.device, checked: bool = False):
        # checked: a pair of the shapes of one that passed these checks (Buffer.dispatch's ShapeCache
        # key holds checks.fp8_pair_key); the checks are skipped, the wire is made as always
        if not isinstance(x, (tuple, list)):
            check_tensor(name, x, dtype=torch.bfloat16, ndim=2, device=device)
            self.num_tokens, self.hidden, self.is_fp8, self.x, self.tensors = x.shape[0], x.shape[1], False, x, (x,)
            return
        if len(x) != 2:
            raise EPInputError(name, f"an FP8 input must be a (values, scales) pair, got {len(x)} items")
        values, scales = x
        if not checked:
            check_tensor(f"{name}[0]", values, dtype=FP8_DTYPE, ndim=2, device=device)
        num_tokens, hidden = values.shape
        if not checked:
            if hidden % GROUP:
                raise EPInputError(f"{name}[0]", f"hidden size {hidden} must be a multiple of {GROUP} for FP8")
            check_tensor(f"{name}[1]", scales, dtypes=SCALE_DTYPES, shape=(num_tokens, None), device=device,
                         contiguous=False)
            if scales.shape[1] < 1:
                raise EPInputError(f"{name}[1]", "must have at least one scale word per token")
        self.num_tokens, self.hidden, self.is_fp8 = num_tokens, hidden, True
        self._dtype, self._width = scales.dtype, scales.shape[1]
        slot = hidden // GROUP
        if self._width == slot:
            wire = (values, scales if scales.dtype == torch.float32 else scales.view(torch.float32))
        else:
            extra = 0 if self._width < slot else -(-4 * (self._width - slot) // (GROUP + 4)) * GROUP
            slot += extra // GROUP
            words = torch.zeros(num_tokens, slot, dtype=torch.int32, device=scales.device)
            in_slot = min(slot, self._width)
            words[:, :in_slot] = scales[:, :in_slot].view(torch.int32)
            if extra:
                wide = torch.zeros(num_tokens, hidden + extra, dtype=torch.uint8, device=values.device)
                wide[:, :hidden] = values.view(torch.uint8)
                if in_slot < self._width:
                    rest = scales[:, in_slot:].view(torch.int32).contiguous().view(torch.uint8)
                    wide[:, hidden:hidden + rest.shape[1]] = rest
                values = wide.view(FP8_DTYPE)
            wire = (values, words.view(torch.float32))
        self.x = wire
        self.tensors = (x[0], x[1]) + wire

    def restore(self, recv_x):
        """The backend's received payload in the caller's format: bf16 as it is; FP8 values
        ``[N, H]`` and scales ``[N, S]`` of the caller's dtype, row-major (DeepEP's layout)."""
        if not self.is_fp8:
            return recv_x
        values, words = recv_x
        slot = words.shape[1]
        if values.shape[1] == self.hidden and slot == self._width:
            return values, words if self._dtype == torch.float32 else words.view(self._dtype)
        in_slot = min(slot, self._width)
        scales = torch.empty(values.shape[0], self._width, dtype=torch.int32, device=words.device)
        scales[:, :in_slot] = words[:, :in_slot].view(torch.int32)
        if in_slot < self._width:
            rest = values[:, self.hidden:].view(torch.uint8)[:, :4 * (self._width - in_slot)]
            scales[:, in_slot:] = rest.contiguous().view(torch.int32)
        if values.shape[1] != self.hidden:
            values = values[:, :self.hidden].contiguous()
        return values, scales.view(self._dtype)


def plain_pair(pair_key) -> bool:
    """Whether an FP8 pair whose checks.fp8_pair_key is ``pair_key`` has float32 scales of the
    slot's width (``H/128``, any strides): its DispatchPayload's wire is the pair itself and
    :meth:`DispatchPayload.restore` returns what the backend received, so a checked pair of these
    shapes needs no payload (about 3 µs of host time per call)."""
    values_key, scales_dtype, scales_shape = pair_key[1], pair_key[3], pair_key[4]
    return scales_dtype == torch.float32 and scales_shape[1] * GROUP == values_key[2][1]


def dispatch_payload(name: str, x, device: torch.device, checked: bool = False):
    """``(num_tokens, hidden, is_fp8, DispatchPayload)`` of a normal dispatch's ``x``; EPInputError
    naming ``name`` (or ``name[0]`` / ``name[1]``) if it is neither bf16 nor an FP8 pair (unless
    ``checked``: a pair of shapes that passed, DispatchPayload says)."""
    payload = DispatchPayload(name, x, device, checked)
    return payload.num_tokens, payload.hidden, payload.is_fp8, payload
