"""argparse types the command-line tools share (``epcomm bench``, ``epcomm model``, the CLI)."""
from __future__ import annotations

import argparse


def _parsed(text: str, kind, lowest, strict: bool):
    """``text`` as ``kind`` (int or float), finite and at least ``lowest`` (above it if ``strict``)."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'a whole number' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    finite = kind is int or value - value == 0  # (inf - inf and nan - nan are nan)
    if not finite or value < lowest or (strict and value == lowest):
        bound = f"> {lowest}" if strict else f">= {lowest}"
        raise argparse.ArgumentTypeError(f"must be {'a finite number ' if kind is float else ''}{bound}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _parsed(text, int, 1, strict=False)


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (0 usually means "automatic")."""
    return _parsed(text, int, 0, strict=False)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _parsed(text, float, 0, strict=True)


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _parsed(text, float, 0, strict=False)


def hidden_size(text: str) -> int:
    """argparse type: a hidden size the FP8 paths accept (a positive multiple of 128)."""
    value = positive_int(text)
    if value % 128:
        raise argparse.ArgumentTypeError(f"must be a multiple of 128 (FP8 scales cover 128 channels), got {value}")
    return value


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun``, plural unless one: ``counted(1, "GPU rank")`` is "1 GPU rank"."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


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


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape of a modelled batch (``epcomm model``, ``epcomm model-one-node``): DeepEP's test shape."""
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=positive_int, default=7168, help="hidden size H")
    parser.add_argument("--topk", type=positive_int, default=8, help="experts per token")
    parser.add_argument("--experts", type=positive_int, default=256, help="experts in total")
