"""Byte counts as text, for reprs and the command's reports."""

from __future__ import annotations


def human_bytes(nbytes: float) -> str:
    """``536870912`` -> ``'512.0 MiB'`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if nbytes < 1024 or unit == "EiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError

