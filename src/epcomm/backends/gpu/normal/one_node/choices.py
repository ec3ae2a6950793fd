"""The one-node normal mode's kernel choices (mode.py, NormalMode): the defaults, and the variants
that measurements set (``epcomm bench normal --variants``, scripts/kernels_alone.py, the shared-GPU
bed's ``VARIANT``). Each is compiled into the plans of a shape, so setting one drops the plans and
the next call binds the kernels anew; the calls themselves look nothing up per choice."""
from __future__ import annotations

from typing import Any, Callable, Tuple


class Choice:
    """A NormalMode attribute, stored as ``_<name>`` on the instance (the mode's ``__init__`` sets
    the default there), whose setting calls the owner's ``_choice_changed()``. ``convert`` turns
    the value set into the one stored (``bool`` for the switches)."""

    def __init__(self, doc: str, convert: Callable[[Any], Any] = bool):
        self.__doc__, self.convert = doc, convert

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, mode, owner=None):
        return self if mode is None else getattr(mode, self.slot)

    def __set__(self, mode, value) -> None:
        setattr(mode, self.slot, self.convert(value))
        mode._choice_changed()


def programs_per_sm(value) -> int:
    """A count of programs per Config.num_sms, checked: 1 to 4 (the grid caps of ranks sharing a
    GPU count 4 x num_sms waiting programs: gpu/shared_grids.py)."""
    count = int(value)
    if not 1 <= count <= 4:
        raise ValueError(f"programs per num_sms must be 1 to 4 (shared_grids.py counts 4 x num_sms), got {value!r}")
    return count


def combine_split(split) -> Tuple[int, int]:
    """``(push, reduce)`` programs per Config.num_sms of the one-launch combine, checked: each at
    least 1, together at most 4 (the grid caps of ranks sharing a GPU count 4 x num_sms)."""
    push, reduce = (int(n) for n in split)
    if push < 1 or reduce < 1 or push + reduce > 4:
        raise ValueError(f"combine_split {split!r}: push and reduce programs per num_sms must each be >= 1 "
                         f"and together <= 4 (shared_grids.py counts 4 x num_sms)")
    return push, reduce
