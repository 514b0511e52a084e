"""Batch-invariant attention: a query's output bits depend on its own row only.

Off by default. When on (``gqakv.set_batch_invariant(True)``, ``with
gqakv.batch_invariant():``, or ``GQAKV_BATCH_INVARIANT=1`` in the environment), every
attention call is planned so that a query's result does not depend on the other rows of
the batch, on how its row's tokens were cut into chunks, on the step's thread split, or on
whether its prefix came from the prefix cache or from its own prefill:

- each query is its own tile (its keys are read for it alone), so a query's key range
  ends at its own position, whatever chunk it came in;
- its keys are folded in blocks of a fixed width starting at its first visible key, in
  key order, by one implementation per dtype and storage (no switch between kernels and
  BLAS by chunk length, no key split among threads, no shared-prefix decomposition);
- the results for given K/V, query, position, heads and variant are then the same bits.

The mode is read when a call is validated (``AttentionInputs.invariant``), so a plan keeps
the mode it was made in for every layer it runs. It costs throughput where a backend would
have tiled queries or split keys: prefill chunks and decode batches of few long rows
(numbers in the performance guide). Implementations declare whether they honour it
(``FastPath.invariant``); a backend whose route for a call does not refuses the call in
this mode, naming the implementation, rather than compute bits that depend on the batch.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

#: The environment variable that turns the mode on for a process ("1", "true", "yes", "on").
ENV = "GQAKV_BATCH_INVARIANT"


def _from_env() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: use 1 or 0")


_MODE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("gqakv_batch_invariant", default=None)
_DEFAULT = [None]  # the process-wide setting (None: the environment's)


def enabled() -> bool:
    """Whether attention calls validated now are batch-invariant (see the module docstring)."""
    mode = _MODE.get()
    if mode is not None:
        return mode
    if _DEFAULT[0] is None:
        _DEFAULT[0] = _from_env()
    return bool(_DEFAULT[0])


def _flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {value!r}")
    return value


def set_batch_invariant(on: bool) -> None:
    """Turn batch-invariant attention on or off for the process (threads that entered a
    ``batch_invariant`` block keep theirs)."""
    _DEFAULT[0] = _flag(on, "on")


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """Batch-invariant attention (or not, ``on=False``) inside the block, in this thread
    and context only."""
    token = _MODE.set(_flag(on, "on"))
    try:
        yield
    finally:
        _MODE.reset(token)


__all__ = ["ENV", "batch_invariant", "enabled", "set_batch_invariant"]
