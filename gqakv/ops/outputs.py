"""Handing an attention result to the caller's output buffers (``out=`` / ``lse_out=``),
for every path that computes into arrays of its own first (a plan without backend work,
the NumPy and CuPy backends' unplanned calls, the shared-prefix merge)."""

from __future__ import annotations


def write_into(result, return_lse: bool, out, lse_out):
    """``result`` of an attention call made with ``return_lse=True``, i.e. ``(o, lse)``,
    copied into the caller's ``out`` / ``lse_out`` where given; returns what the call
    returns: ``out`` (or o), with the lse (``lse_out`` or lse) when ``return_lse``."""
    o, lse = result
    if out is not None:
        out[...] = o
        o = out
    if lse_out is not None:
        lse_out[...] = lse
        lse = lse_out
    return (o, lse) if return_lse else o


__all__ = ["write_into"]
