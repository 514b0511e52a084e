"""Reused per-thread memory for the CPU paths' temporaries.

A prefill walks hundreds of items per thread and a decode step runs the same small call
in every layer; fresh buffers of a few hundred KiB or more are mapped, faulted in and
zeroed by the kernel each time (one such allocation per read cost about 50 us). So the
paths that own their temporaries (``numpy_batch``'s one pass, ``amx_prefill``'s items)
take them from here: one growing block of memory per thread and name.
"""

from __future__ import annotations

import math
import threading

import numpy as np

_LOCAL = threading.local()


def thread_buffer(name: str, shape: tuple, dtype) -> np.ndarray:
    """A C-contiguous ``shape`` array of this thread's reused memory for ``name`` (not
    zeroed; valid until this thread asks for ``name`` again, so each caller prefixes its
    names with its own). The same array object while ``shape`` and ``dtype`` stay (every
    layer of a step asks for the same)."""
    last = getattr(_LOCAL, name, None)
    if last is not None and last[0] == shape and last[1] == dtype:
        return last[3]
    size = math.prod(shape) * np.dtype(dtype).itemsize
    memory = last[2] if last is not None and last[2].size >= size else np.empty(size, np.uint8)
    array = memory[:size].view(dtype).reshape(shape)
    setattr(_LOCAL, name, (shape, dtype, memory, array))
    return array
