"""Build the CUDA kernels for the CPU and run cupy-backend launch plans on them.

``build(asan=False, head_dims=HEAD_DIMS)`` compiles driver.cpp (which includes the
backend's .cu files unchanged) with g++ and the cuda_emu.h shim into a shared library
with every kernel x dtype for those head dims, cached under the temp directory by a hash
of the sources and flags. ``Emulator.run(plan, arrays)`` copies
NumPy arrays into exactly-sized malloc'd buffers, optionally poisons byte ranges (under
AddressSanitizer any access there aborts with a report), performs every launch of a
``gqakv_backends.cupy_backend.plan.Plan`` with the plan's own grid, block and typed
arguments, and copies the buffers back.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from gqakv_backends.cupy_backend import limits
from gqakv_backends.cupy_backend import plan as planmod
from gqakv_backends.cupy_backend import sources

HERE = Path(__file__).resolve().parent
#: Head dims instantiated in the emulation library (tests pick among these).
HEAD_DIMS = (20, 64, 128, 80, 256)  # 80, 256: the tensor-core prefill's other tile shapes
#: Head dims the variant kernels (window / softcap / sinks) are instantiated at in the
#: emulation library: 64 (vector loads, both tensor-core kernels) and 20 (scalar loads).
VARIANT_HEAD_DIMS = (64, 20)
#: Head dims the paged instantiations (kernels/paged_kv.cuh) are built at, and the variant
#: flags each is built for: plain causal and all three features (window 1 + softcap 2 +
#: sinks 4; the reader is orthogonal to the variant trait, and each flag doubles the build).
PAGED_HEAD_DIMS = (64, 20)
PAGED_VARIANTS = (0, 7)
#: Head dims the variant kernels over quantized K/V are instantiated at (q float32 / bfloat16).
QUANTIZED_VARIANT_HEAD_DIMS = (64,)
#: Kernel families a library holds beside the plain (contiguous, unquantized) kernels. The
#: default library holds both; a one-head-dim library (emulated_backend) is built with the
#: families its launches name, so a small head dim pays only for what its tests run.
FAMILIES = ("paged", "quantized")


def kernel_dir() -> Path:
    return Path(str(sources.resources.files(sources.__package__).joinpath("kernels")))


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def run_asan_child(argv: list[str], cwd=None, timeout: float = 900):
    """``python *argv`` with libasan preloaded (leak checks off), after building the ASan
    library here without a time limit (the child only loads it): its CompletedProcess
    (text output captured), or None when g++ has no AddressSanitizer runtime."""
    runtime = asan_runtime()
    if runtime is None:
        return None
    build(asan=True)
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0")
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def asan_runtime() -> str | None:
    """Path of libasan for LD_PRELOAD (a plain Python must load it first)."""
    cxx = compiler()
    if cxx is None:
        return None
    out = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def _flags(asan: bool, head_dims: tuple[int, ...] = HEAD_DIMS,
           families: tuple[str, ...] = FAMILIES) -> list[str]:
    dims = " ".join(f"GQAKV_REG_DIM({d})" for d in head_dims)
    # The variant instantiations (window / softcap / sinks flags 1..7) at VARIANT_HEAD_DIMS.
    dims += " " + " ".join(f"GQAKV_REG_VARIANTS_DIM({d})" for d in VARIANT_HEAD_DIMS if d in head_dims)
    if "paged" in families:
        # The paged instantiations: PAGED_VARIANTS at PAGED_HEAD_DIMS, plain causal at any other
        # head dim of a library of its own (the paged caches of the parity suite, e.g. d = 4).
        flags_list = ", ".join(map(str, PAGED_VARIANTS))
        dims += " " + " ".join(f"GQAKV_REG_PAGED_DIM({d}, {flags_list})" for d in PAGED_HEAD_DIMS
                               if d in head_dims)
        if tuple(head_dims) != HEAD_DIMS:
            dims += "".join(f" GQAKV_REG_PAGED_DIM({d}, 0)" for d in head_dims if d not in PAGED_HEAD_DIMS)
    if "quantized" in families:
        # The quantized (int8 / e4m3 K/V) instantiations at every head dim, their variants at
        # QUANTIZED_VARIANT_HEAD_DIMS.
        dims += " " + " ".join(f"GQAKV_REG_QUANTIZED_DIM({d})" for d in head_dims)
        dims += " " + " ".join(f"GQAKV_REG_QUANTIZED_VARIANTS_DIM({d})" for d in QUANTIZED_VARIANT_HEAD_DIMS
                               if d in head_dims)
        if len(head_dims) == 1 and head_dims[0] not in QUANTIZED_VARIANT_HEAD_DIMS:
            # A one-dim library (emulated_backend.emulator: the parity suite's small head dims)
            # serves quantized float32 caches under every variant (tests/conftest.py's product).
            dims += f" GQAKV_REG_QUANTIZED_VARIANTS_F32_DIM({head_dims[0]})"
    # The kernels' limits as -D options, as NVRTC gets them (sources.COMPILE_OPTIONS).
    flags = ["-std=c++20", "-g", "-pthread", "-shared", "-fPIC", f"-I{kernel_dir()}",
             f"-include{HERE / 'cuda_emu.h'}", f"-DGQAKV_EMU_HEAD_DIMS={dims}",
             *limits.define_options()]
    if asan:
        # alignment too: a misaligned 16-byte load faults on a GPU but runs on x86
        flags += ["-O1", "-fsanitize=address,alignment", "-fno-sanitize-recover=alignment",
                  "-fno-omit-frame-pointer"]
    else:
        flags += ["-O2"]
    return flags


def library_path(asan: bool, head_dims: tuple[int, ...] = HEAD_DIMS,
                 families: tuple[str, ...] = FAMILIES) -> Path:
    digest = hashlib.sha256()
    for p in sorted(kernel_dir().glob("*.cu*")) + [HERE / "cuda_emu.h", HERE / "driver.cpp"]:
        digest.update(p.name.encode() + p.read_bytes())
    digest.update(" ".join(_flags(asan, head_dims, families)).encode())
    tag = "asan" if asan else "opt"
    return Path(tempfile.gettempdir()) / "gqakv_cuda_emu" / f"libgqakv_emu_{tag}_{digest.hexdigest()[:16]}.so"


def build(asan: bool = False, head_dims: tuple[int, ...] = HEAD_DIMS,
          families: tuple[str, ...] = FAMILIES) -> Path:
    """Compile (once per source version, head-dim set and families) and return the
    library path."""
    out = library_path(asan, head_dims, families)
    if out.exists():
        return out
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, *_flags(asan, head_dims, families), str(HERE / "driver.cpp"), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"emulation build failed:\n{' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, out)
    return out


class _AttnParams(ctypes.Structure):
    """kernels/variant.cuh's AttnParams (plan.PARAMS_DTYPE), aligned as the C++ struct."""

    _fields_ = [("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("window", ctypes.c_int64),
                ("sinks", ctypes.c_uint64), ("k_scale", ctypes.c_uint64), ("v_scale", ctypes.c_uint64)]


assert ctypes.sizeof(_AttnParams) == planmod.PARAMS_DTYPE.itemsize


class _KVPages(ctypes.Structure):
    """kernels/paged_kv.cuh's KVPages (plan.PAGES_DTYPE), aligned as the C++ struct."""

    _fields_ = [("table", ctypes.c_uint64), ("table_stride", ctypes.c_int64),
                ("page_size", ctypes.c_int32), ("page_magic", ctypes.c_uint32),
                ("page_shift", ctypes.c_int32)]


assert ctypes.sizeof(_KVPages) == planmod.PAGES_DTYPE.itemsize


class Emulator:
    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        c = ctypes
        self.lib.emu_launch.argtypes = [c.c_char_p, c.POINTER(c.c_uint), c.POINTER(c.c_uint),
                                        c.POINTER(c.c_void_p), c.POINTER(c.c_size_t), c.c_int]
        self.lib.emu_alloc.restype = c.c_void_p
        self.lib.emu_alloc.argtypes = [c.c_size_t]
        self.lib.emu_free.argtypes = [c.c_void_p]
        self.lib.emu_poison.argtypes = [c.c_void_p, c.c_size_t]
        self.lib.emu_unpoison.argtypes = [c.c_void_p, c.c_size_t]
        self.launches = 0

    def run(self, plan: planmod.Plan, arrays: dict[str, np.ndarray],
            poison: dict[str, list[tuple[int, int]]] | None = None) -> None:
        """Run every launch of ``plan`` on ``arrays`` (updated in place).

        poison: array name -> (byte offset, byte count) ranges no kernel may touch.
        Names bound to the same array (e.g. ``dst_k`` and ``src_k`` for rows of one cache)
        share one allocation, as they would on the device; partial overlaps are refused.
        """
        arrays = dict(arrays)
        aliases: dict[str, str] = {}
        by_memory: dict[tuple[int, int], str] = {}
        for name, a in list(arrays.items()):
            key = (a.ctypes.data, a.nbytes)
            if key in by_memory:
                aliases[name] = by_memory[key]
                del arrays[name]
                continue
            for other in by_memory.values():
                if np.shares_memory(a, arrays[other]):
                    raise ValueError(f"{name} partially overlaps {other}")
            by_memory[key] = name
        for name, shape in plan.workspace.items():
            arrays[name] = np.full(shape, np.nan, dtype=np.float32)  # garbage, like cupy.empty
        arrays.setdefault("dummy", np.full(1, np.nan, dtype=np.float32))
        ptrs: dict[str, int] = {}
        poisoned: list[tuple[int, int]] = []
        try:
            for name, a in arrays.items():
                a = np.ascontiguousarray(a)
                p = self.lib.emu_alloc(a.nbytes)
                ptrs[name] = p
                ctypes.memmove(p, a.ctypes.data, a.nbytes)
            for name, target in aliases.items():
                ptrs[name] = ptrs[target]
            for name, ranges in (poison or {}).items():
                for off, n in ranges:
                    if n > 0:
                        self.lib.emu_poison(ptrs[name] + off, n)
                        poisoned.append((ptrs[name] + off, n))
            for launch in plan.launches:
                self._launch(launch, ptrs)
        finally:
            for p, n in poisoned:
                self.lib.emu_unpoison(p, n)
        for name, a in arrays.items():
            ctypes.memmove(a.ctypes.data, ptrs[name], a.nbytes)
            self.lib.emu_free(ptrs[name])

    def _launch(self, launch: planmod.Launch, ptrs: dict[str, int]) -> None:
        c = ctypes
        holders = []
        for a in launch.args:
            if isinstance(a, planmod.Buf):
                holders.append(c.c_void_p(ptrs[a.name]))
            elif isinstance(a, np.int32):
                holders.append(c.c_int32(int(a)))
            elif isinstance(a, np.int64):
                holders.append(c.c_int64(int(a)))
            elif isinstance(a, np.float32):
                holders.append(c.c_float(float(a)))
            elif isinstance(a, planmod.KernelParams):
                rec = a.record(lambda buf: ptrs[buf.name])
                holders.append(_AttnParams(float(rec["scale"]), float(rec["softcap"]),
                                           int(rec["window"]), int(rec["sinks"]),
                                           int(rec["k_scale"]), int(rec["v_scale"])))
            elif isinstance(a, planmod.PageTableArg):
                rec = a.record(lambda buf: ptrs[buf.name])
                holders.append(_KVPages(int(rec["table"]), int(rec["table_stride"]),
                                        int(rec["page_size"]), int(rec["page_magic"]),
                                        int(rec["page_shift"])))
            else:
                raise TypeError(f"{launch.name}: argument {a!r} has no explicit CUDA type")
        argv = (c.c_void_p * len(holders))(*[c.cast(c.pointer(h), c.c_void_p) for h in holders])
        sizes = (c.c_size_t * len(holders))(*[c.sizeof(h) for h in holders])
        grid = (c.c_uint * 3)(*launch.grid)
        block = (c.c_uint * 3)(*launch.block)
        rc = self.lib.emu_launch(launch.name.encode(), grid, block, argv, sizes, len(holders))
        if rc == 1:
            raise KeyError(f"{launch.name} is not instantiated in the emulation library")
        if rc == 2:
            raise TypeError(f"{launch.name}: argument count or sizes do not match the kernel")
        if rc == 3:
            raise ValueError(f"{launch.name}: bad launch shape grid={launch.grid} block={launch.block}")
        self.launches += 1
