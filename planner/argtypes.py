"""argparse types shared by every meshplan command (planner's and executor's): one line on a bad value."""
from __future__ import annotations

import argparse


def int_at_least(minimum: int, what: str):
    """An argparse type: an integer >= ``minimum``, described as ``what`` in the error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


positive_int = int_at_least(1, "a positive integer")


def recompute(text: str) -> str:
    """An argparse type: a recompute policy or ``every-K`` (planner/recompute.py)."""
    from .errors import UserError
    from .recompute import parse_recompute
    try:
        return parse_recompute(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(e.detail) from None
