"""Compile the kernels with NVRTC through ctypes, with no GPU and no CuPy.

Used by the compile test (tests/test_cupy_nvrtc.py) and by anyone who wants the ptxas
report: the NVRTC shared library comes from the ``nvidia-cuda-nvrtc-cu12`` wheel (or
``GQAKV_NVRTC``/the system). It compiles ``sources.compose_source(kernel)`` with
``sources.COMPILE_OPTIONS``, the same text and options the cupy backend hands to
``cupy.RawModule``, straight to CUBIN for a given ``sm_XX`` with ``ptxas -v``.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from dataclasses import dataclass

from . import sources


class NvrtcError(RuntimeError):
    pass


def find_libnvrtc() -> str | None:
    """Path of libnvrtc: $GQAKV_NVRTC, the nvidia-cuda-nvrtc wheel, then the loader's default."""
    env = os.environ.get("GQAKV_NVRTC")
    if env:
        return env
    for base in sys.path:
        hits = sorted(glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")))
        hits = [h for h in hits if ".alt." not in h and "builtins" not in h]
        if hits:
            return hits[-1]
    return "libnvrtc.so" if _loadable("libnvrtc.so") else None


def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class CompileResult:
    name: str  # the name expression
    lowered: str  # its mangled symbol
    arch: str
    cubin_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int
    log: str


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


class Nvrtc:
    def __init__(self, path: str | None = None):
        path = path or find_libnvrtc()
        if path is None:
            raise NvrtcError("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12)")
        self.lib = ctypes.CDLL(path)
        self.path = path
        c = ctypes
        self.lib.nvrtcGetErrorString.restype = c.c_char_p
        self.lib.nvrtcGetLoweredName.argtypes = [c.c_void_p, c.c_char_p, c.POINTER(c.c_char_p)]

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def _check(self, rc: int, what: str, log: str = "") -> None:
        if rc != 0:
            msg = self.lib.nvrtcGetErrorString(rc).decode()
            raise NvrtcError(f"{what} failed: {msg}\n{log}")

    def compile(self, kernel: str, dtype: str, head_dim: int, arch: str = "sm_90",
                name: str | None = None) -> CompileResult:
        """Compile one instantiation to CUBIN for ``arch`` and parse ptxas' report.

        name: the name expression (default: ``sources.name_expression(kernel, dtype,
        head_dim)``; pass one of ``sources.instantiations`` for kernels with more
        template parameters, such as the decode kernel's query tile)."""
        c = ctypes
        name = name or sources.name_expression(kernel, dtype, head_dim)
        src = sources.compose_source(kernel).encode()
        prog = c.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(c.byref(prog), src, f"{kernel}.cu".encode(),
                                                0, None, None), "nvrtcCreateProgram")
        try:
            self._check(self.lib.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
            opts = [o.encode() for o in (*sources.COMPILE_OPTIONS, f"--gpu-architecture={arch}",
                                         "--ptxas-options=-v")]
            arr = (c.c_char_p * len(opts))(*opts)
            rc = self.lib.nvrtcCompileProgram(prog, len(opts), arr)
            log = self._log(prog)
            self._check(rc, f"compiling {name} for {arch}", log)
            lowered = c.c_char_p()
            self._check(self.lib.nvrtcGetLoweredName(prog, name.encode(), c.byref(lowered)),
                        "nvrtcGetLoweredName")
            size = c.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, c.byref(size)), "nvrtcGetCUBINSize")
            return _parse(name, (lowered.value or b"").decode(), arch, size.value, log)
        finally:
            self.lib.nvrtcDestroyProgram(c.byref(prog))

    def lowered_names(self, kernel: str, names: list[str], arch: str = "compute_90") -> dict[str, str]:
        """Compile ``kernel``'s source once with every name expression of ``names`` (to PTX
        for a virtual ``arch``: no ptxas) and return name -> mangled symbol; NvrtcError when
        the source does not compile or a name does not resolve."""
        c = ctypes
        src = sources.compose_source(kernel).encode()
        prog = c.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(c.byref(prog), src, f"{kernel}.cu".encode(),
                                                0, None, None), "nvrtcCreateProgram")
        try:
            for name in names:
                self._check(self.lib.nvrtcAddNameExpression(prog, name.encode()),
                            f"nvrtcAddNameExpression({name})")
            opts = [o.encode() for o in (*sources.COMPILE_OPTIONS, f"--gpu-architecture={arch}")]
            rc = self.lib.nvrtcCompileProgram(prog, len(opts), (c.c_char_p * len(opts))(*opts))
            self._check(rc, f"compiling {len(names)} instantiations of {kernel} for {arch}", self._log(prog))
            out = {}
            for name in names:
                lowered = c.c_char_p()
                self._check(self.lib.nvrtcGetLoweredName(prog, name.encode(), c.byref(lowered)),
                            f"nvrtcGetLoweredName({name})")
                out[name] = (lowered.value or b"").decode()
            return out
        finally:
            self.lib.nvrtcDestroyProgram(c.byref(prog))

    def _log(self, prog) -> str:
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, buf)
        return buf.value.decode(errors="replace")


def _parse(name: str, lowered: str, arch: str, cubin_bytes: int, log: str) -> CompileResult:
    """Pick the ptxas lines of the entry ``lowered`` out of the log."""
    section = None
    for block in re.split(r"(?=ptxas info\s+: Compiling entry function)", log):
        m = _PTXAS_FUNC.search(block)
        if m and m.group(1) == lowered:
            section = block
    if section is None:
        raise NvrtcError(f"no ptxas report for {name} ({lowered}) in the log:\n{log}")
    stack = _PTXAS_STACK.search(section)
    regs = _PTXAS_REGS.search(section)
    smem = _PTXAS_SMEM.search(section)
    if not (stack and regs):
        raise NvrtcError(f"could not parse the ptxas report for {name}:\n{section}")
    return CompileResult(name=name, lowered=lowered, arch=arch, cubin_bytes=cubin_bytes,
                         registers=int(regs.group(1)), stack_bytes=int(stack.group(1)),
                         spill_stores=int(stack.group(2)), spill_loads=int(stack.group(3)),
                         shared_bytes=int(smem.group(1)) if smem else 0, log=log)
