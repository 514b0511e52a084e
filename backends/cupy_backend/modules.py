"""Compiled kernels on the current CUDA device, built once and kept.

``get_function(kernel, name)`` compiles ``sources.compose_source(kernel)`` with
``cupy.RawModule(code=..., name_expressions=[name], options=COMPILE_OPTIONS)`` the first
time a (device, instantiation) is asked for (``name`` is a ``sources.name_expression``,
which fixes dtype, head dim and any other template parameter) and returns the cached
``RawKernel`` afterwards (CuPy also keeps the CUBIN in its on-disk cache). CuPy is
imported here only, inside functions.
"""

from __future__ import annotations

import threading

from . import sources

_lock = threading.Lock()
_functions: dict[tuple[int, str], object] = {}


def get_function(kernel: str, name: str):
    import cupy

    device = cupy.cuda.Device().id
    key = (device, name)
    fn = _functions.get(key)
    if fn is None:
        with _lock:
            fn = _functions.get(key)
            if fn is None:
                module = cupy.RawModule(code=sources.compose_source(kernel),
                                        options=sources.COMPILE_OPTIONS,
                                        name_expressions=[name])
                fn = module.get_function(name)
                _functions[key] = fn
    return fn


def run_plan(plan, arrays: dict, dtype: str, head_dim: int) -> None:
    """Launch every kernel of ``plan`` with ``Buf`` names resolved from ``arrays``.

    Workspace buffers named by the plan and not in ``arrays`` are allocated here
    (uninitialized: the kernels write every element that is read); a planned batch
    (work.py) hands its own, allocated once.
    """
    import cupy

    from .plan import Buf, KernelParams, PageTableArg

    arrays = dict(arrays)
    for name, shape in plan.workspace.items():
        if name not in arrays:
            arrays[name] = cupy.empty(shape, dtype=cupy.float32)
    if "dummy" not in arrays:
        arrays["dummy"] = cupy.empty(1, dtype=cupy.float32)
    for launch in plan.launches:
        fn = get_function(launch.kernel, launch.name)
        # A KernelParams goes by value as a NumPy record of the kernels' struct (CuPy passes
        # structured scalars as raw bytes), the sinks array by its device address; so does
        # a PageTableArg (KVPages), with the page table's address.
        args = tuple(arrays[a.name] if isinstance(a, Buf)
                     else a.record(lambda buf: arrays[buf.name].data.ptr)
                     if isinstance(a, (KernelParams, PageTableArg))
                     else a for a in launch.args)
        fn(launch.grid, launch.block, args)
