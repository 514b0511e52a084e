"""The real cupy backend, run on the CPU: a test-only backend named ``cupy_emulated``.

``EmulatedCupyBackend`` is ``gqakv_backends.cupy_backend.CupyBackend`` given another
runtime (``runtime.CupyRuntime``, the object through which the backend reaches CuPy),
which substitutes two things and nothing else:

* array allocation: a small stand-in for the cupy module whose arrays are
  ``EmulatedDeviceArray`` (a NumPy subclass with ``.get()`` like a CuPy array, so a plain
  NumPy array is still "another library" to the cache), each on one of two emulated
  devices (the current one of the thread when it was made; ``EmulatedDevice(i)``, the
  stand-in's ``cuda.Device``, switches);
* kernel launch: instead of ``modules.run_plan``, a runner that refuses arrays of a device
  other than the current one (a GPU would fault) and executes the plan's launches
  (grid, block, typed arguments exactly as built by the backend's planner) on the CPU
  emulation harness (``harness.Emulator``), one emulation library per head dim, compiled
  with g++ on first use.

Everything else is the backend's own code: ``write_kv``, ``copy_tokens``, ``attention``,
their routing and generic fallbacks, strides, the upload of rows/lengths, the output
pre-fill, the planner (with an H200's 132 SMs), the bfloat16 handling.

The stand-in is handed to the backend, never installed: ``sys.modules`` and
``modules.run_plan`` stay as they are, so the real ``cupy`` backend keeps reporting "not
installed" and no other code ever sees a fake cupy. Arrays are NumPy memory, so a kernel
sees the array's own bytes from its first element (a strided view is handed over as the
byte span it covers, its pointer and strides unchanged, as on a device).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import types

import numpy as np

from gqakv_backends.cupy_backend import CupyBackend
from gqakv_backends.cupy_backend import instantiations as table
from gqakv_backends.cupy_backend.runtime import CupyRuntime

from . import harness

#: Multiprocessor count the planner is given (an H200's), so plans match that device's.
SM_COUNT = 132


#: Device ids the stand-in offers (two, so that device switching is exercised).
DEVICES = (0, 1)
_local = threading.local()  # the current device is per thread, as in CUDA
#: One emulated launch at a time (the emulation library keeps the launch in globals).
_launch_lock = threading.Lock()


def _device_stack() -> list[int]:
    """This thread's devices made current (a stack: the top is the current device)."""
    stack = getattr(_local, "devices", None)
    if stack is None:
        stack = _local.devices = [0]
    return stack


def current_device() -> int:
    return _device_stack()[-1]


class EmulatedDevice:
    """``cupy.cuda.Device`` stand-in: ``Device()`` is the current device, ``Device(i)`` one
    of DEVICES; entering it makes it current until exit, as in CuPy."""

    attributes = {"MultiProcessorCount": SM_COUNT}
    compute_capability = "90"  # an H200's, as CuPy spells it

    def __init__(self, device=None):
        if device is None:
            device = current_device()
        if device not in DEVICES:
            raise ValueError(f"the emulated devices are {DEVICES}, got {device!r}")
        self.id = int(device)

    def __enter__(self):
        _device_stack().append(self.id)
        return self

    def __exit__(self, *exc):
        _device_stack().pop()
        return False


class EmulatedDeviceArray(np.ndarray):
    """NumPy memory standing for a CuPy array on an emulated device (``emu_device``: the
    device current when it was made; views and results inherit their source's).

    Its ``.device`` stays NumPy's ``"cpu"``: the backend's array-API fallbacks (float64,
    d > 256) pass it on to NumPy functions, as they pass a CuPy device on to CuPy.
    """

    def __array_finalize__(self, obj):
        self.emu_device = getattr(obj, "emu_device", current_device())

    def get(self) -> np.ndarray:
        """Host copy, like ``cupy.ndarray.get``."""
        return np.array(self, subok=False)

    def set(self, arr) -> None:
        """Host-to-device copy into this array, like ``cupy.ndarray.set``: a NumPy array
        of the same shape and dtype (no allocation on the device)."""
        if isinstance(arr, EmulatedDeviceArray) or not isinstance(arr, np.ndarray):
            raise TypeError(f"set takes a host NumPy array, got {type(arr).__name__}")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"set: {arr.dtype}{list(arr.shape)} into {self.dtype}{list(self.shape)}")
        np.copyto(self, arr)


def _on_device(a: np.ndarray) -> EmulatedDeviceArray:
    """``a``'s memory as an array on the current emulated device."""
    out = a.view(EmulatedDeviceArray)
    out.emu_device = current_device()
    return out


def _empty(shape, dtype=float):
    """Uninitialized like ``cupy.empty``: floating buffers hold NaN, so a read before a
    write shows."""
    a = np.empty(shape, dtype=dtype)
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        a.fill(np.nan)
    return _on_device(a)


def _asarray(a, dtype=None):
    """``cupy.asarray``: a device array as it is (cast if asked), a host array copied over."""
    if isinstance(a, EmulatedDeviceArray):
        return a if dtype is None or a.dtype == dtype else _on_device(np.array(a, dtype=dtype))
    return _on_device(np.array(a, dtype=dtype, copy=True))


def _fake_cupy() -> types.SimpleNamespace:
    """The parts of the cupy API that CupyBackend calls, on EmulatedDeviceArray."""
    cp = types.SimpleNamespace()
    cp.__version__ = "emulated"
    cp.ndarray = EmulatedDeviceArray
    for name in ("float16", "float32", "float64", "int32", "int64"):
        setattr(cp, name, getattr(np, name))
    cp.asarray = _asarray
    cp.empty = _empty
    cp.zeros = lambda shape, dtype=float: _on_device(np.zeros(shape, dtype=dtype))
    cp.full = lambda shape, fill, dtype=None: _on_device(np.full(shape, fill, dtype=dtype))
    cp.ascontiguousarray = lambda a: _on_device(np.ascontiguousarray(a))
    stream = types.SimpleNamespace(synchronize=lambda: None, ptr=0)
    cp.cuda = types.SimpleNamespace(Device=EmulatedDevice, get_current_stream=lambda: stream)
    return cp


def memory_span(a: np.ndarray) -> np.ndarray:
    """The bytes from a's first element to its last one, as a uint8 array sharing a's
    memory: what a kernel given a's pointer and strides may address."""
    a = np.asarray(a)
    if any(s < 0 for s in a.strides):
        raise ValueError(f"negative strides {a.strides} cannot be handed to a kernel")
    if a.size == 0:
        return np.empty(0, dtype=np.uint8)
    extent = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) + a.itemsize
    return np.ctypeslib.as_array((ctypes.c_ubyte * extent).from_address(a.ctypes.data))


def emulator(head_dim: int, families: tuple[str, ...] = harness.FAMILIES) -> harness.Emulator:
    """An emulation library holding every kernel x dtype for ``head_dim``: the harness's
    default one for its head dims, else one for this head dim alone with the kernel
    ``families`` asked for beside the plain ones (g++, seconds, cached on disk by the
    harness); at PRODUCT_HEAD_DIM also the product's variants (``_product_library``)."""
    if "grouped" in families:  # a library of its own (harness.grouped_units)
        return _grouped_library(head_dim)
    if head_dim in harness.HEAD_DIMS:
        # only the default library's units of this head dim: a test here need not wait for
        # the rest of it
        return _library(harness.HEAD_DIMS, harness.FAMILIES, head_dim)
    wanted = tuple(f for f in harness.FAMILIES if f in families)
    if head_dim == PRODUCT_HEAD_DIM:
        return _product_library(wanted)
    return _library((head_dim,), wanted)


#: The head dim of the product suite's tests (tests/conftest.py ``case``: d = 8), whose
#: one-dim library also holds the variant instantiations the product runs, in every
#: dtype and family: window 1, softcap 2, sinks 4, all three 7, alibi 8, all four 15
#: (kernels/variant.cuh flags). The harness's one-dim libraries hold plain causal kernels only (and quantized
#: float32 variants), so without these the product's fast paths could not run here.
PRODUCT_HEAD_DIM = 8
#: Each feature alone, window+softcap+sinks, and all of them together (instantiations.VARIANT_FLAGS):
#: the product's ATTENTION_PARAMS.
PRODUCT_VARIANT_FLAGS = tuple(v for v in (*table.VARIANT_FLAGS.values(), table.ALL & ~table.VARIANT_FLAGS["alibi"],
                                           table.ALL) if not v & table.TREE)
#: The draft tree's instantiations in the product's library (its "tree" family: the prefill
#: kernels only): the tree with each of the product's flag sets, plain causal included (the
#: parity product runs a tree chunk at every point: tests/test_variants.py), in every dtype
#: and storage of the product.
PRODUCT_TREE_FLAGS = tuple(table.TREE | v for v in (0, *PRODUCT_VARIANT_FLAGS))


def product_registrations(families: tuple[str, ...], d: int = PRODUCT_HEAD_DIM) -> list[harness.Unit]:
    """Build units (harness.Unit) of the product's variants at head dim ``d`` for
    ``families`` (beside the plain kernels), selected from the instantiation table: one per
    q dtype (and code dtype), so they compile in parallel and are cached one by one."""
    v = PRODUCT_VARIANT_FLAGS
    storages = [(None, "contiguous")]
    if "paged" in families:
        storages.append((None, "paged"))
    if "quantized" in families:
        storages += [(c, "contiguous") for c in table.STORAGES["quantized"]]
        if "paged" in families:
            storages += [(c, "paged") for c in table.STORAGES["quantized"]]
    units = []
    for kv, reader in storages:
        kind = "product " + ("paged " if reader == "paged" else "") + (kv or "variants")
        units += [harness.unit(kind, d, table.select(dtypes=(t,), head_dims=(d,), kv_dtypes=(kv,),
                                                     readers=(reader,), variants=v))
                  for t in table.CTYPES]
        if "tree" in families:  # the draft tree's, units of their own
            units += [harness.unit(kind + " tree", d, table.select(dtypes=(t,), head_dims=(d,), kv_dtypes=(kv,),
                                                                   readers=(reader,), variants=PRODUCT_TREE_FLAGS))
                      for t in table.CTYPES]
    return [u for u in units if u.entries]


@functools.cache
def _product_library(families: tuple[str, ...]) -> harness.Emulator:
    """The PRODUCT_HEAD_DIM library of ``families`` (the harness's units) plus the units of
    ``product_registrations``, compiled and cached by the harness's builder as its own
    units are (``harness.build_registrations``)."""
    paths = harness.build(asan=False, head_dims=(PRODUCT_HEAD_DIM,), families=families)
    variants = harness.build_registrations(False, product_registrations(families), wait=True)
    return harness.Emulator([*paths, *variants])


@functools.cache
def _grouped_library(head_dim: int) -> harness.Emulator:
    """The grouped codecs' kernels at ``head_dim`` (harness.grouped_units: every launch a
    grouped cache makes, its row copies included)."""
    return harness.Emulator(harness.build_registrations(False, harness.grouped_units(head_dim)))


#: What in a launch's name says which kernel family (harness.FAMILIES, and "grouped") it
#: belongs to (the 8-bit per-token code types end where the grouped ones go on: "gqakv_i8g<").
_FAMILY_MARKS = {"paged": ("KVPages",), "quantized": ("gqakv_i8>", "gqakv_i8,", "gqakv_e4m3"),
                 "grouped": ("gqakv_i8g<", "gqakv_i4g<")}


@functools.cache
def grouped_only_copies(head_dim: int) -> frozenset[str]:
    """The copy instantiations only a grouped cache launches at ``head_dim`` (its codes as
    byte rows of d * bits / 8, its scales as rows of d / g: instantiations.copy_entries),
    none of which a plain or per-token cache's copy there names: the grouped library holds
    them. (A grouped copy always names one: a 4-bit code row is d / 2 bytes, an 8-bit one's
    scales d / 32 floats; at d = 32 both of int8_g32's are int8's, in either library.)"""
    names = {e.name for e in harness.grouped_copy_entries(head_dim, tuple(table.CTYPES))}
    others = {e.name for t in table.CTYPES for kv in (None, *table.STORAGES["quantized"])
              for e in table.copy_entries(t, head_dim, kv)}
    return frozenset(names - others)


def plan_families(plan, head_dim: int) -> tuple[str, ...]:
    """The kernel families ``plan``'s launches at ``head_dim`` need (plain kernels are
    always there; a draft tree's launches, whose parameters name its arrays, need the
    "tree" family; a grouped cache's row copies, "grouped": ``grouped_only_copies``)."""
    names = " ".join(launch.name for launch in plan.launches)
    tree = any(getattr(a, "tree_mask", None) is not None for launch in plan.launches for a in launch.args)
    grouped_copy = any(launch.name in grouped_only_copies(head_dim) for launch in plan.launches)
    return (*(f for f, marks in _FAMILY_MARKS.items() if any(m in names for m in marks)
              or (f == "grouped" and grouped_copy)),
            *(("tree",) if tree else ()))


@functools.cache
def _library(head_dims: tuple[int, ...], families: tuple[str, ...],
             only_head_dim: int | None = None) -> harness.Emulator:
    return harness.Emulator(harness.build(asan=False, head_dims=head_dims, families=families,
                                          only_head_dim=only_head_dim))


#: One-head-dim libraries the suite's tests on this backend ask for (the small head dims of
#: the parity and product tests), queued by ``prebuild_for`` in this order (the order the
#: tests first need them). A stale entry costs a build no test waits for; a missing one, a
#: build a test waits for.
SMALL_LIBRARIES = ((1, ()), (16, ()), (8, ()), (4, ()), (8, ("paged",)), (8, ("quantized",)),
                   (8, ("paged", "quantized")),
                   (2, ()), (16, ("quantized",)), (4, ("paged",)), (2, ("paged",)), (16, ("paged",)),
                   (8, ("tree",)), (8, ("paged", "tree")), (8, ("quantized", "tree")),
                   (8, ("paged", "quantized", "tree")))


def prebuild_for(items) -> None:
    """Queue, for background compiling, the emulation libraries that the collected pytest
    ``items`` will load: with a test parametrized by this backend (``backend``, ``case``),
    SMALL_LIBRARIES and the default library (the backend's head dims in harness.HEAD_DIMS);
    with a test of a module that makes this backend itself, the one-dim library of its
    ``head_dim`` parameter; with a grouped codec's product point, the grouped library at
    its head dim; with a test of a module that builds the default library, that
    one; with an AddressSanitizer test, the ASan library (its child process loads it).
    Anything else is compiled when first asked for (``build``: in parallel, waited for)."""
    if harness.compiler() is None:
        return
    from ..support.product import GROUPED_HEAD_DIM, GROUPED_SPECS

    on_param = uses_default = asan = grouped = False
    dims: list[int] = []
    makes: dict[object, tuple[bool, bool]] = {}  # module -> its source makes a backend, a library
    for item in items:
        module = getattr(item, "module", None)
        if module not in makes:
            try:
                with open(getattr(module, "__file__", None) or "") as f:
                    text = f.read()
            except OSError:
                text = ""
            makes[module] = ("EmulatedCupyBackend" in text, "harness.build(" in text)
        makes_backend, builds = makes[module]
        params = getattr(getattr(item, "callspec", None), "params", {})
        param = any(isinstance(v, EmulatedCupyBackend) or (isinstance(v, tuple) and v
                                                          and isinstance(v[0], EmulatedCupyBackend))
                    for v in params.values())
        d = params.get("head_dim")
        if makes_backend and isinstance(d, int) and d not in harness.HEAD_DIMS and d not in dims:
            dims.append(d)
        on_param |= param
        # a grouped codec's product point (tests/support/product.py GROUPED_SPECS)
        grouped |= any(isinstance(v, tuple) and len(v) > 1 and isinstance(v[0], EmulatedCupyBackend)
                       and v[1] in GROUPED_SPECS for v in params.values())
        uses_default |= param or builds
        asan |= "address_sanitizer" in item.name
    if on_param:
        for d, families in SMALL_LIBRARIES:
            harness.prebuild(head_dims=(d,), families=families)
            if d == PRODUCT_HEAD_DIM:  # and the product's variants (_product_library)
                harness.build_registrations(False, product_registrations(families), wait=False)
    if grouped:  # the grouped library at the product's grouped head dim (_grouped_library)
        harness.build_registrations(False, harness.grouped_units(GROUPED_HEAD_DIM), wait=False)
    if uses_default:
        harness.prebuild()
    if asan and harness.asan_runtime() is not None:
        harness.prebuild(asan=True)
    for d in dims:
        harness.prebuild(head_dims=(d,), families=())


class _DeviceNamespace:
    """array_api_compat.numpy whose ``empty`` allocates on the current emulated device, as
    CuPy's namespace allocates on the device (a quantized store allocates its codes there:
    gqakv.storage.codecs.Codec.allocate_parts); everything else is NumPy's."""

    def __init__(self, xp):
        self._xp = xp

    def __getattr__(self, name):
        return getattr(self._xp, name)

    def empty(self, shape, dtype=None, device=None):
        return _on_device(self._xp.empty(shape, dtype=dtype))


class EmulatedCupyBackend(CupyBackend):
    """CupyBackend on the CPU: NumPy-backed device arrays, kernels on the emulator."""

    name = "cupy_emulated"
    priority = -100  # test-only: never an automatic choice
    array_library = "cupy (emulated: NumPy memory)"
    device_kind = "cuda (emulated on the CPU)"

    def __init__(self):
        # The launcher is looked up per launch, so a test may replace ``_run_plan``.
        super().__init__(CupyRuntime(_fake_cupy(), lambda *args: self._run_plan(*args)))
        #: Kernel launches run so far (tests count them to see the fused path was taken).
        self.launches = 0

    def unavailable_reason(self) -> str | None:
        if harness.compiler() is None:
            return "cupy_emulated: no C++ compiler (g++) for the CUDA emulation harness"
        return None

    def device_of(self, x):
        """The emulated device id (CupyBackend reads ``x.device.id``; see EmulatedDeviceArray)."""
        return getattr(x, "emu_device", 0)

    def namespace(self):
        import array_api_compat.numpy as xp  # the stand-in arrays are NumPy arrays

        return _DeviceNamespace(xp)

    def _run_plan(self, plan, arrays: dict, dtype: str, head_dim: int) -> None:
        """The runtime's launcher: ``modules.run_plan``'s contract on the emulator: same
        plan, same buffers (their bytes).

        Like a CUDA launch, it runs on the current device, and refuses (where a GPU would
        fault) any array that lives on another one."""
        current = current_device()
        for name, a in arrays.items():
            where = getattr(a, "emu_device", current)
            if where != current:
                raise RuntimeError(f"illegal address: {name} is on device {where}, the kernel "
                                   f"was launched on device {current}")
        with _launch_lock:
            emulator(head_dim, plan_families(plan, head_dim)).run(plan, {name: memory_span(a)
                                                               for name, a in arrays.items()})
            self.launches += len(plan.launches)


def kernels_only(monkeypatch, what: str) -> EmulatedCupyBackend:
    """An EmulatedCupyBackend whose generic fallbacks fail (``what``: the kernels a test
    means, for the message; other backends, the references, keep their generic code) and
    whose launched kernel names are recorded in ``backend.kernels``, in order."""
    from gqakv.dispatch.backend import Backend

    be = EmulatedCupyBackend()
    be.kernels = []  # type: ignore[attr-defined]  # a test's record, not a backend field
    run = be._run_plan

    def record(plan, *args):
        be.kernels.extend(launch.name for launch in plan.launches)  # type: ignore[attr-defined]
        return run(plan, *args)

    be._run_plan = record  # type: ignore[method-assign]
    for op in ("write_kv", "attention", "copy_tokens"):
        def refuse(self, *args, _op=op, _generic=getattr(Backend, op), **kwargs):
            if self is be:
                raise AssertionError(f"the generic {_op} ran: the {what} were not used")
            return _generic(self, *args, **kwargs)
        monkeypatch.setattr(Backend, op, refuse)
    return be
