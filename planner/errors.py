"""Errors a user can act on.

Every error meshplan raises for bad input is a ``UserError``: one sentence that
names the source (file or flag), the field, the value and what is allowed. The
CLI prints it on one line and exits with ``exit_code`` (2 for bad input, 3 when
no plan fits) without a traceback; ``--debug`` shows one.
"""
from __future__ import annotations


class UserError(Exception):
    """Bad input: the message says which source, which field, what is allowed."""

    exit_code = 2
    trailer = ""        # printed after the one line (the traceback of the user's own code that raised)

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.source = source
        self.field = field
        self.detail = message           # the message without "source: field: "
        where = ""
        if source and field:
            where = f"{source}: {field}: "
        elif source:
            where = f"{source}: "
        elif field:
            where = f"{field}: "
        super().__init__(where + message)


class NoFeasiblePlan(UserError):
    """The request is well formed but no candidate fits in memory; ``answer``: what --json prints of it
    (the least memory any candidate needs and the changes that would fit: planner.explain.NoFit)."""

    exit_code = 3

    def __init__(self, message: str, *, answer: dict | None = None):
        super().__init__(message)
        self.answer = answer or {}


def one_of(values) -> str:
    """'a, b or c' for an error message."""
    values = [str(v) for v in values]
    if len(values) <= 1:
        return "".join(values)
    return ", ".join(values[:-1]) + " or " + values[-1]
