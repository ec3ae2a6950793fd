"""argparse types the command-line tools share (``epcomm bench``, ``epcomm model``, the CLI)."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (0 usually means "automatic")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def hidden_size(text: str) -> int:
    """argparse type: a hidden size the FP8 paths accept (a positive multiple of 128)."""
    value = positive_int(text)
    if value % 128:
        raise argparse.ArgumentTypeError(f"must be a multiple of 128 (FP8 scales cover 128 channels), got {value}")
    return value


def token_list(text: str):
    """argparse type: comma-separated positive ints ('' = none)."""
    return [positive_int(t) for t in text.split(",") if t.strip()]


def switch_list(text: str):
    """argparse type: comma-separated settings of an on/off switch, each 0 or 1 ('' = none)."""
    values = []
    for item in text.split(","):
        if not item.strip():
            continue
        if item.strip() not in ("0", "1"):
            raise argparse.ArgumentTypeError(f"each value must be 0 or 1, got {item.strip()!r}")
        values.append(int(item))
    return values
