"""Argument validation for the public API.

Each check raises :class:`EPInputError` naming the argument. Checks run before any communication,
on every rank, so an invalid call fails the same way everywhere and the buffer stays usable.
Value checks that need the tensor's contents (``topk_idx`` ranges) read device memory; on CUDA
they run only where the Buffer asks for them (``check_values``), because they force a host
synchronisation.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .errors import EPInputError
from .handle import DispatchHandle, LowLatencyHandle


def value_checks_enabled(device: torch.device) -> bool:
    """Value checks by default: on CPU tensors (they cost no host synchronisation there)."""
    return device.type == "cpu"


def check_int(name: str, value, minimum: Optional[int] = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise EPInputError(name, f"must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise EPInputError(name, f"must be >= {minimum}, got {value}")
    return value


def check_tensor(name: str, t, *, dtype=None, dtypes: Sequence[torch.dtype] = (), ndim: Optional[int] = None,
                 shape: Optional[Sequence[Optional[int]]] = None, device: Optional[torch.device] = None,
                 contiguous: bool = True) -> torch.Tensor:
    """Type, dtype, rank, shape (``None`` = any size), device and contiguity of one tensor.
    (On every call's host path: the valid case reads each attribute once and builds nothing.)"""
    if not isinstance(t, torch.Tensor):
        raise EPInputError(name, f"must be a torch.Tensor, got {type(t).__name__}")
    got_dtype = t.dtype
    if (dtype is not None or dtypes) and got_dtype is not dtype and got_dtype not in dtypes:
        allowed = tuple(dtypes) + ((dtype,) if dtype is not None else ())
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise EPInputError(name, f"must have dtype {names}, got {str(got_dtype).replace('torch.', '')}")
    got_shape = t.shape
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and len(got_shape) != ndim:
        raise EPInputError(name, f"must be {ndim}-dimensional, got shape {tuple(got_shape)}")
    if shape is not None:
        for want, got in zip(shape, got_shape):
            if want is not None and want != got:
                _raise_shape(name, shape, got_shape)
    if device is not None:
        got_device = t.device
        if got_device != device and not _same_device(got_device, device):
            raise EPInputError(name, f"must be on {device}, got {got_device}")
    if contiguous and not t.is_contiguous():
        raise EPInputError(name, "must be contiguous")
    return t


def _raise_shape(name: str, shape, got_shape) -> None:
    expected = tuple("*" if s is None else s for s in shape)
    axis = next(i for i, (want, got) in enumerate(zip(shape, got_shape)) if want is not None and want != got)
    raise EPInputError(name, f"must have shape {expected}, got {tuple(got_shape)} (dim {axis})")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        return (a.index if a.index is not None else torch.cuda.current_device()) == \
               (b.index if b.index is not None else torch.cuda.current_device())
    return True


def check_rows(num_tokens: int, owner: str, **tensors) -> None:
    """``x``, ``topk_idx``, ``topk_weights`` (and ``is_token_in_rank``) hold one row per token: the
    first of ``tensors`` with another number of rows than ``owner``'s ``num_tokens`` raises
    EPInputError naming it and both counts (before its other checks, which would blame its shape)."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and tensor.shape[0] != num_tokens:
            raise EPInputError(name, f"has {tensor.shape[0]} rows but {owner} has {num_tokens}: x, topk_idx and "
                                     f"topk_weights hold one row per token")


def check_topk_idx(name: str, topk_idx: torch.Tensor, num_experts: int, device: torch.device,
                   num_tokens: Optional[int] = None, check_values: Optional[bool] = None) -> torch.Tensor:
    """``[T, K]`` int64 expert ids in ``[-1, num_experts)``. The range check reads the values (a host
    sync on CUDA): it runs when ``check_values`` (default: :func:`value_checks_enabled`). Without it,
    the GPU kernels drop out-of-range ids and the next call raises EPInputError."""
    check_tensor(name, topk_idx, dtype=torch.int64, shape=(num_tokens, None), device=device)
    if check_values is None:
        check_values = value_checks_enabled(topk_idx.device)
    if check_values:
        check_topk_values(name, topk_idx, num_experts)
    return topk_idx


def check_topk_values(name: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    """The range part of :func:`check_topk_idx` alone (reads the values: a host sync on CUDA)."""
    if topk_idx.numel():
        low, high = int(topk_idx.min()), int(topk_idx.max())
        if low < -1 or high >= num_experts:
            raise EPInputError(name, f"values must lie in [-1, {num_experts}), got range [{low}, {high}]")


# ---------------------------------------------------------------------- checks once per shape
# A call's shape checks depend only on each argument's metadata (class, dtype, shape, device,
# contiguity) and on its plain int arguments. Buffer keeps the keys of the argument sets that passed
# (ShapeCache) and runs the checks in full only for a key it has not seen; value checks, and checks
# of objects a key does not describe (a handle), run on every call.
SHAPE_CACHE_SIZE = 64  # distinct argument shapes remembered per Buffer and call (then it starts again)


class ShapeCache(set):
    """Keys (:func:`dispatch_key`, :func:`layout_key`) of argument sets whose shape checks passed.
    A lookup is ``key in cache`` (a plain set; None, no key, is never added), in a ``try`` where a
    key may not hash (an argument of the wrong kind: it never passed the checks)."""

    __slots__ = ()

    def remember(self, key) -> None:
        if key is None:
            return
        if len(self) >= SHAPE_CACHE_SIZE:
            self.clear()
        try:
            self.add(key)
        except TypeError:
            pass


def tensor_key(t) -> Optional[tuple]:
    """What a tensor's shape checks read: class, dtype, shape, device and contiguity (None for
    None; AttributeError for anything without them)."""
    return None if t is None else (t.__class__, t.dtype, t.shape, t.device, t.is_contiguous())


def dispatch_key(cached: bool, x, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                 num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens) -> Optional[tuple]:
    """What Buffer.dispatch's shape checks of these arguments depend on: whether a handle was given
    (``cached``: the checks differ), each tensor's :func:`tensor_key`, and the two ints with their
    types. ``x``: the bf16 tensor, or a tuple standing for an FP8 pair (:func:`fp8_pair_key`). None
    where an argument has no such attributes (the checks then run, and raise)."""
    try:
        return (cached, x if x.__class__ is tuple else tensor_key(x),
                expert_alignment.__class__, expert_alignment, num_worst_tokens.__class__, num_worst_tokens,
                tensor_key(num_tokens_per_rank), tensor_key(num_tokens_per_rdma_rank), tensor_key(is_token_in_rank),
                tensor_key(num_tokens_per_expert), tensor_key(topk_idx), tensor_key(topk_weights))
    except (AttributeError, TypeError):
        return None


def fp8_pair_key(x) -> Optional[tuple]:
    """What an FP8 pair's checks read (fp8.DispatchPayload): the values' :func:`tensor_key`, and
    the scales' class, dtype, shape and device (any strides); None for anything but a pair."""
    try:
        if len(x) != 2:
            return None
        values, scales = x
        return ("fp8", tensor_key(values), scales.__class__, scales.dtype, scales.shape, scales.device)
    except (AttributeError, TypeError):
        return None


def low_latency_dispatch_key(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, flags: tuple,
                             stats: tuple) -> Optional[tuple]:
    """What Buffer.low_latency_dispatch's shape checks depend on (:func:`dispatch_key`'s rules):
    ``x`` and ``topk_idx``, the two ints with their types, ``flags`` (use_fp8, round_scale,
    use_ue8m0, use_nvfp4 as given) and the two optional ``stats`` tensors."""
    try:
        return (tensor_key(x), tensor_key(topk_idx), num_max_dispatch_tokens_per_rank.__class__,
                num_max_dispatch_tokens_per_rank, num_experts.__class__, num_experts, flags,
                tensor_key(stats[0]), tensor_key(stats[1]))
    except (AttributeError, TypeError):
        return None


def low_latency_combine_key(x, topk_idx, topk_weights, out, stats, handle: LowLatencyHandle) -> Optional[tuple]:
    """What Buffer.low_latency_combine's shape checks depend on, past the handle's own check (which
    runs on every call): the tensors, and the handle's sizes that x's shape and the tokens' bound
    come from."""
    try:
        return (tensor_key(x), tensor_key(topk_idx), tensor_key(topk_weights), tensor_key(out), tensor_key(stats),
                handle.num_experts, handle.num_max_dispatch_tokens_per_rank, handle.hidden)
    except (AttributeError, TypeError):
        return None


def layout_key(topk_idx, num_experts) -> Optional[tuple]:
    """What get_dispatch_layout's shape checks depend on (:func:`dispatch_key`'s rules)."""
    try:
        return (tensor_key(topk_idx), num_experts.__class__, num_experts)
    except (AttributeError, TypeError):
        return None


def check_routing_counts(num_tokens_per_rank: torch.Tensor, is_token_in_rank: torch.Tensor,
                         num_tokens_per_expert: torch.Tensor, topk_idx: Optional[torch.Tensor], num_ranks: int,
                         num_tokens_per_rdma_rank: Optional[torch.Tensor] = None, ranks_per_node: int = 0) -> None:
    """The counts a caller passes to dispatch must be what they summarise (they size the exchange:
    wrong ones return uninitialised rows or break the collectives). Reads values."""
    from .layout import tokens_per_expert, tokens_to_ranks
    column_sums = is_token_in_rank.sum(0, dtype=torch.int32)
    if not torch.equal(column_sums, num_tokens_per_rank):
        raise EPInputError("num_tokens_per_rank", f"{num_tokens_per_rank.tolist()} does not match the column sums of "
                                                  f"is_token_in_rank {column_sums.tolist()}")
    if num_tokens_per_rdma_rank is not None:
        num_nodes = num_ranks // ranks_per_node
        per_node = is_token_in_rank.view(is_token_in_rank.shape[0], num_nodes, ranks_per_node).any(-1) \
            .sum(0, dtype=torch.int32)
        if not torch.equal(per_node, num_tokens_per_rdma_rank):
            raise EPInputError("num_tokens_per_rdma_rank", f"{num_tokens_per_rdma_rank.tolist()} does not match "
                                                           f"is_token_in_rank, which gives {per_node.tolist()} per node")
    if topk_idx is None:
        return
    num_experts = num_tokens_per_expert.numel()
    if not torch.equal(tokens_to_ranks(topk_idx, num_experts, num_ranks), is_token_in_rank):
        raise EPInputError("is_token_in_rank", "does not match topk_idx (was it computed from another routing?)")
    counts = tokens_per_expert(topk_idx, num_experts)
    if not torch.equal(counts, num_tokens_per_expert):
        raise EPInputError("num_tokens_per_expert", f"{num_tokens_per_expert.tolist()} does not match topk_idx, "
                                                    f"which gives {counts.tolist()}")


def check_topk_weights(name: str, topk_weights: torch.Tensor, shape, device: torch.device) -> torch.Tensor:
    return check_tensor(name, topk_weights, dtype=torch.float32, shape=shape, device=device)


def check_num_experts(num_experts, num_ranks: int) -> int:
    check_int("num_experts", num_experts, minimum=1)
    if num_experts % num_ranks:
        raise EPInputError("num_experts", f"{num_experts} is not divisible by the group size {num_ranks}")
    return num_experts


def check_payload(name: str, x, device: torch.device, num_tokens: Optional[int] = None):
    """``x`` is bf16 ``[T, H]`` or an FP8 tuple ``(e4m3 [T, H], float32 [T, H/128])``.

    FP8 scales may be row-major or column-major (strides ``(1, T)``). Returns ``(T, H, is_fp8)``.
    """
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise EPInputError(name, f"an FP8 input must be a (values, scales) pair, got {len(x)} items")
        values, scales = x
        check_tensor(f"{name}[0]", values, dtype=torch.float8_e4m3fn, shape=(num_tokens, None), device=device)
        num_tokens, hidden = values.shape
        if hidden % 128:
            raise EPInputError(f"{name}[0]", f"hidden size {hidden} must be a multiple of 128 for FP8")
        check_tensor(f"{name}[1]", scales, dtype=torch.float32, shape=(num_tokens, hidden // 128),
                     device=device, contiguous=False)
        strides = scales.stride()
        if not (strides == (hidden // 128, 1) or strides == (1, num_tokens) or num_tokens <= 1):
            raise EPInputError(f"{name}[1]", "scales must be row-major or column-major")
        return num_tokens, hidden, True
    check_tensor(name, x, dtype=torch.bfloat16, shape=(num_tokens, None), device=device)
    return x.shape[0], x.shape[1], False


def view_of_bytes(memory: torch.Tensor, dtype, size=None, offset: int = 0) -> torch.Tensor:
    """``memory`` (uint8, 1-D) from byte ``offset`` on, viewed as ``dtype`` — the first
    ``size.numel()`` elements shaped ``size`` when given; EPInputError naming a bad argument."""
    if not isinstance(dtype, torch.dtype):
        raise EPInputError("dtype", f"must be a torch.dtype, got {type(dtype).__name__}")
    element = torch.empty((), dtype=dtype).element_size()
    check_int("offset", offset, minimum=0)
    if offset % element or offset > memory.numel():
        raise EPInputError("offset", f"must be a multiple of {element} bytes within the {memory.numel()} bytes of "
                                     f"the buffer, got {offset}")
    tensor = memory[offset:offset + (memory.numel() - offset) // element * element].view(dtype)
    if size is None:
        return tensor
    size = torch.Size(size)
    if size.numel() > tensor.numel():
        raise EPInputError("size", f"{list(size)} needs {size.numel()} elements; the buffer holds {tensor.numel()} "
                                   f"of {dtype} after byte {offset}")
    return tensor[:size.numel()].view(size)


def dispatched_entry(handle, dispatched_entries) -> Optional[tuple]:
    """The ``(handle, topk_idx)`` of the low-latency dispatch that made ``handle``, among
    ``dispatched_entries`` (the last two dispatches of a Buffer, None where none was made yet), or
    None: an older handle, whose buffer half was reused (DeepEP's rule), or another Buffer's."""
    for entry in dispatched_entries:  # (a plain loop: this runs on every call's host path)
        if entry is not None and entry[0] is handle:
            return entry
    return None


def check_combine_topk_idx(topk_idx: torch.Tensor, dispatched: Optional[tuple], check_values: bool) -> None:
    """``topk_idx`` of a low-latency combine must be its dispatch's (``dispatched``, from
    :func:`dispatched_entry`; None: not checked): the shape always, the values with
    ``check_values`` (a host read on CUDA) unless it is the very tensor."""
    if dispatched is None or dispatched[1] is topk_idx:
        return
    dispatched = dispatched[1]
    if dispatched.shape != topk_idx.shape:
        raise EPInputError("topk_idx", f"has shape {list(topk_idx.shape)} but the low_latency_dispatch of this "
                                       f"handle had {list(dispatched.shape)}: pass the same topk_idx")
    if check_values and not torch.equal(dispatched, topk_idx):
        raise EPInputError("topk_idx", "differs from the one the low_latency_dispatch of this handle was given: "
                                       "pass the same topk_idx")


def check_dispatch_handle(handle, num_ranks: int):
    """A normal-mode handle made by a Buffer of this group size: a ``DispatchHandle`` whose
    ``rank_prefix_matrix`` is ``[R, R]`` and whose ``is_token_in_rank`` is ``[T, R]``. A handle of
    another Buffer would otherwise reach the exchange with the wrong split sizes."""
    if not isinstance(handle, DispatchHandle):
        raise EPInputError("handle", f"must be a DispatchHandle from a normal-mode dispatch, got {type(handle).__name__}")
    prefix, in_rank = handle.rank_prefix_matrix.shape, handle.is_token_in_rank.shape
    if prefix != (num_ranks, num_ranks) or len(in_rank) != 2 or in_rank[1] != num_ranks:
        raise EPInputError("handle", f"was made by a Buffer of {prefix[0]} ranks (rank_prefix_matrix "
                                     f"{list(prefix)}); this Buffer's group has {num_ranks}")
    return handle


def check_low_latency_handle(handle, num_ranks: int):
    """A low-latency handle made by a Buffer of this group size: ``recv_layout_range`` is
    ``[E_local, R]`` and ``num_experts`` a multiple of ``R``."""
    if not isinstance(handle, LowLatencyHandle):
        raise EPInputError("handle", f"must be a LowLatencyHandle from low_latency_dispatch, got {type(handle).__name__}")
    layout = handle.recv_layout_range
    if layout.dim() != 2 or layout.shape[1] != num_ranks or handle.num_experts % num_ranks or \
            layout.shape[0] != handle.num_experts // num_ranks:
        raise EPInputError("handle", f"was made by a Buffer of {layout.shape[-1]} ranks (recv_layout_range "
                                     f"{list(layout.shape)}, {handle.num_experts} experts); this Buffer's group has "
                                     f"{num_ranks}")
    return handle
