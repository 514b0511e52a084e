"""Seeds for parametrized tests: the same numbers in every run (Python's ``hash`` of a
string changes from one process to the next, so a failure it drew could not be replayed)."""

from __future__ import annotations

import zlib


def stable_seed(*parts) -> int:
    """A 32-bit seed from ``parts`` (their ``repr``), equal in every process."""
    return zlib.crc32(repr(parts).encode())
