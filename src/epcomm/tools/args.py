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


def hidden_size(text: str) -> int:
    """argparse type: a hidden size the FP8 paths accept (a positive multiple of 128)."""
    value = positive_int(text)
    if value % 128:
        raise argparse.ArgumentTypeError(f"must be a multiple of 128 (FP8 scales cover 128 channels), got {value}")
    return value


def token_list(text: str):
    """argparse type: comma-separated positive ints ('' = none)."""
    return [positive_int(t) for t in text.split(",") if t.strip()]
