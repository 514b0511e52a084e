"""Build the CUDA kernels for the CPU and run cupy-backend launch plans on them.

``build(asan=False, head_dims=HEAD_DIMS)`` compiles driver.cpp (which includes the
backend's .cu files unchanged) with g++ and the cuda_emu.h shim into a library with every
kernel x dtype for those head dims: one shared object per build unit (``registrations``: a
selection from the instantiation table, backends/cupy_backend/instantiations.py, whose
registration code is generated here and included by driver.cpp), compiled in parallel and
cached under the temp directory by a hash of the sources, compiler, flags and entries, so
libraries that share a unit build it once;
``prebuild`` queues a library's missing units to compile in the background (the test
session starts them at collection, tests/conftest.py). ``Emulator.run(plan, arrays)`` copies
NumPy arrays into exactly-sized malloc'd buffers, optionally poisons byte ranges (under
AddressSanitizer any access there aborts with a report), performs every launch of a
``gqakv_backends.cupy_backend.plan.Plan`` with the plan's own grid, block and typed
arguments, and copies the buffers back.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gqakv_backends.cupy_backend import instantiations as table
from gqakv_backends.cupy_backend import limits
from gqakv_backends.cupy_backend import plan as planmod
from gqakv_backends.cupy_backend import sources, structs

try:
    import fcntl
except ImportError:  # not POSIX: units are not locked against other processes
    fcntl = None  # type: ignore[assignment]

HERE = Path(__file__).resolve().parent
#: Head dims instantiated in the emulation library (tests pick among these).
HEAD_DIMS = (20, 64, 128, 80, 256)  # 80, 256: the tensor-core prefill's other tile shapes
#: Head dims the variant kernels (window / softcap / sinks) are instantiated at in the
#: emulation library: 64 (vector loads, both tensor-core kernels) and 20 (scalar loads).
VARIANT_HEAD_DIMS = (64, 20)
#: The variant flags they are instantiated for: every combination of window, softcap and
#: sinks, ALiBi alone and every feature at once (each flag set is another build of every
#: variant kernel: ALiBi's other combinations would double the build for no new code path).
_ALIBI = table.VARIANT_FLAGS["alibi"]
VARIANTS = (*range(1, _ALIBI), _ALIBI, table.ALL)
#: Head dims the paged instantiations (kernels/paged_kv.cuh) are built at, and the variant
#: flags each is built for: plain causal, the three features (window 1 + softcap 2 + sinks
#: 4) and all four (+ alibi 8); the reader is orthogonal to the variant trait, and each flag
#: set is another build of every paged kernel.
PAGED_HEAD_DIMS = (64, 20)
PAGED_VARIANTS = (0, table.ALL & ~table.VARIANT_FLAGS["alibi"], table.ALL)  # plain, window+softcap+sinks, all
#: Head dims the variant kernels over quantized K/V are instantiated at (q float32 / bfloat16).
QUANTIZED_VARIANT_HEAD_DIMS = (64,)
#: Head dims and variant flags of the paged 8-bit instantiations (the 8-bit reader over the
#: paged one), as for PAGED_VARIANTS.
PAGED_QUANTIZED_HEAD_DIMS = (64,)
PAGED_QUANTIZED_VARIANTS = (0, 7, 15)
#: The draft tree's instantiations (instantiations.TREE: the prefill kernels only): the
#: head dims they are built at in a library that asks for the "tree" family, and their
#: flags: the tree alone, with a window, with softcap + sinks, with ALiBi + a window and with
#: every feature (tests/test_cupy_emulated_tree.py's variants), in float32 and bfloat16
#: (tensor-core prefill: bfloat16 only), over each storage the library's other families
#: name. d = 16: the smallest head dim both prefill kernels take.
TREE_HEAD_DIMS = (16,)
_W, _C, _S = (table.VARIANT_FLAGS[f] for f in ("window", "softcap", "sinks"))
TREE_VARIANTS = tuple(table.TREE | v for v in (0, _W, _C | _S, _ALIBI | _W, table.ALL))
TREE_DTYPES = ("float32", "bfloat16")
#: Kernel families a library holds beside the plain (contiguous, unquantized) kernels. The
#: default library holds the first two (its head dims have no "tree" units); a one-head-dim
#: library (emulated_backend) is built with the families its launches name, so a small head
#: dim pays only for what its tests run.
FAMILIES = ("paged", "quantized", "tree")
#: The grouped codecs' instantiations (instantiations.STORAGES["grouped"]: a scale per block,
#: 4-bit codes two a byte) are a library of their own per head dim (``grouped_units``), never
#: part of the default one: only the grouped tests load them. Their variants: every variant
#: of the parity product (tests/support/product.py ATTENTION_PARAMS: plain causal, each
#: feature alone, window + soft-cap + sinks, all four), window + soft-cap
#: (tests/test_cupy_emulated_grouped.py), and each of the product's with a draft tree (the
#: prefill kernels only), q float32, bfloat16 and float16 (the rotated codec computes in
#: float32).
GROUPED_PRODUCT_VARIANTS = (0, _W, _C, _S, _W | _C | _S, _ALIBI, table.ALL)
GROUPED_VARIANTS = (*GROUPED_PRODUCT_VARIANTS, _W | _C,
                    *(table.TREE | v for v in GROUPED_PRODUCT_VARIANTS))
GROUPED_DTYPES = ("float32", "bfloat16", "float16")


def kernel_dir() -> Path:
    return Path(str(sources.resources.files(sources.__package__).joinpath("kernels")))


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def run_asan_child(argv: list[str], cwd=None, timeout: float = 900,
                   units: "Sequence[Unit] | None" = None):
    """``python *argv`` with libasan preloaded (leak checks off), after building the ASan
    library here without a time limit (the child only loads it; ``units``: only these
    build units, ``build_registrations``' sense, for a child that loads just them): its
    CompletedProcess (text output captured), or None when g++ has no AddressSanitizer
    runtime."""
    runtime = asan_runtime()
    if runtime is None:
        return None
    if units is None:
        build(asan=True)
    else:
        build_registrations(True, units)
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0")
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def check_asan_main(module: str, passed: int, units: "Sequence[Unit] | None" = None,
                    main: str = "asan_main") -> None:
    """Run ``tests.<module>.<main>()`` (default ``asan_main``) under AddressSanitizer
    (``run_asan_child``; ``units`` as there) and assert it exited 0 after printing
    ``"<passed> passed"``; skips when g++ has no AddressSanitizer runtime."""
    import pytest

    proc = run_asan_child(["-c", f"import sys; from tests import {module} as m; sys.exit(m.{main}())"],
                          cwd=HERE.parents[1], units=units)
    if proc is None:
        pytest.skip("AddressSanitizer runtime (libasan) not found for g++")
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"AddressSanitizer run failed:\n{tail}"
    assert f"{passed} passed" in proc.stdout, tail


def asan_runtime() -> str | None:
    """Path of libasan for LD_PRELOAD (a plain Python must load it first)."""
    cxx = compiler()
    if cxx is None:
        return None
    out = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


@dataclass(frozen=True)
class Unit:
    """One build unit of the emulation library: the table's ``entries``
    (instantiations.Instantiation) that one g++ run instantiates, registered under their
    names (``code``: the C++ driver.cpp includes, GQAKV_EMU_REGISTRATIONS). ``kind`` says
    what it holds ("plain", "variants", ...; the AddressSanitizer build joins the units of
    one kind), ``head_dim`` the head dim they share (None once joined)."""

    kind: str
    head_dim: int | None
    entries: tuple[table.Instantiation, ...]

    @property
    def label(self) -> str:
        return self.kind if self.head_dim is None else f"{self.kind} d={self.head_dim}"

    def code(self) -> str:
        """One registration per entry: its name, and the address of that instantiation."""
        return "".join(f'registry()["{e.name}"] = make_entry(&{e.name});\n' for e in self.entries)


def unit(kind: str, head_dim: int, entries: Sequence[table.Instantiation]) -> Unit:
    return Unit(kind, head_dim, tuple(entries))


def registrations(head_dims: tuple[int, ...] = HEAD_DIMS,
                  families: tuple[str, ...] = FAMILIES) -> list[Unit]:
    """The build units of the library for ``head_dims`` and ``families``, selected from the
    instantiation table (backends/cupy_backend/instantiations.py): every unit is compiled on
    its own (in parallel, ``build``), cached on its own (libraries that share a unit, such as
    the plain kernels of one head dim with and without its paged kernels, build it once).
    Units the table has no entries for (a family it does not instantiate) are left out."""
    sel = table.select
    plain, paged, codes = ("contiguous",), ("paged",), table.STORAGES["quantized"]
    units = [unit("plain", d, sel(head_dims=(d,), kv_dtypes=(None,), readers=plain, variants=(0,)))
             for d in head_dims]
    # The variant instantiations (every flag combination) at VARIANT_HEAD_DIMS.
    units += [unit("variants", d, sel(head_dims=(d,), kv_dtypes=(None,), readers=plain, variants=VARIANTS))
              for d in VARIANT_HEAD_DIMS if d in head_dims]
    if "paged" in families:
        # The paged instantiations: PAGED_VARIANTS at PAGED_HEAD_DIMS, plain causal at any other
        # head dim of a library of its own (the paged caches of the parity suite, e.g. d = 4).
        units += [unit("paged", d, sel(head_dims=(d,), kv_dtypes=(None,), readers=paged,
                                       variants=PAGED_VARIANTS)) for d in PAGED_HEAD_DIMS if d in head_dims]
        if tuple(head_dims) != HEAD_DIMS:
            units += [unit("paged", d, sel(head_dims=(d,), kv_dtypes=(None,), readers=paged, variants=(0,)))
                      for d in head_dims if d not in PAGED_HEAD_DIMS]
    if "quantized" in families:
        # The quantized (int8 / e4m3 K/V) instantiations at every head dim (with the scale
        # copy their row copies launch), their variants at QUANTIZED_VARIANT_HEAD_DIMS (q in
        # float32 and bfloat16).
        units += [unit("quantized", d, [*sel(head_dims=(d,), kv_dtypes=codes, readers=plain, variants=(0,)),
                                        table.SCALE_COPY]) for d in head_dims]
        units += [unit("quantized variants", d, sel(dtypes=("float32", "bfloat16"), head_dims=(d,),
                                                    kv_dtypes=codes, readers=plain, variants=VARIANTS))
                  for d in QUANTIZED_VARIANT_HEAD_DIMS if d in head_dims]
        if len(head_dims) == 1 and head_dims[0] not in QUANTIZED_VARIANT_HEAD_DIMS:
            # A one-dim library (emulated_backend.emulator: the parity suite's small head dims)
            # serves quantized float32 caches under every variant (tests/conftest.py's product).
            units.append(unit("quantized f32 variants", head_dims[0],
                              sel(dtypes=("float32",), head_dims=head_dims, kv_dtypes=codes, readers=plain,
                                  variants=VARIANTS)))
    if "paged" in families and "quantized" in families:
        # Paged quantized K/V (the table's ("quantized", "paged") layout, where declared): as
        # the paged instantiations.
        units += [unit("paged quantized", d, sel(head_dims=(d,), kv_dtypes=codes, readers=paged,
                                                 variants=PAGED_VARIANTS if d in PAGED_HEAD_DIMS else (0,)))
                  for d in head_dims if d in PAGED_HEAD_DIMS or tuple(head_dims) != HEAD_DIMS]
    if "tree" in families:
        # The draft tree's prefill instantiations (TREE_VARIANTS) at TREE_HEAD_DIMS, one unit
        # per storage: contiguous rows, and the paged / 8-bit readers of the other families.
        storages: list[tuple[tuple[str | None, ...], tuple[str, ...], str]] = [((None,), plain, "tree")]
        if "paged" in families:
            storages.append(((None,), paged, "tree paged"))
        if "quantized" in families:
            storages.append((codes[:1], plain, "tree int8"))  # int8: the tests' 8-bit storage
        prefill = [k for k in table.KERNELS if table.KERNELS[k].variant_mask & table.TREE]
        units += [unit(kind, d, sel(kernels=prefill, dtypes=TREE_DTYPES, head_dims=(d,), kv_dtypes=kv,
                                    readers=readers, variants=TREE_VARIANTS))
                  for d in TREE_HEAD_DIMS if d in head_dims for kv, readers, kind in storages]
    return [u for u in units if u.entries]


def grouped_units(head_dim: int, dtypes: tuple[str, ...] = GROUPED_DTYPES,
                  variants: tuple[int, ...] = GROUPED_VARIANTS, readers=("contiguous", "paged"),
                  kind: str = "grouped") -> list[Unit]:
    """Build units of the grouped codecs at ``head_dim``: the append, decode and prefill
    over their codes (one unit per q dtype and reader, so they compile in parallel), and
    the merge their split decode launches (plain: it reads fp32 partials)."""
    sel = table.select
    units = [unit(f"{kind} {t} {r}", head_dim, sel(dtypes=(t,), head_dims=(head_dim,),
                                                   kv_dtypes=table.STORAGES["grouped"], readers=(r,),
                                                   variants=variants))
             for t in dtypes for r in readers]
    merge_flags = tuple(sorted({v & table.VARIANT_FLAGS["sinks"] for v in variants}))
    units.append(unit(f"{kind} merge", head_dim, sel(kernels=["gqakv_merge"], dtypes=dtypes,
                                                     head_dims=(head_dim,), variants=merge_flags)))
    units.append(unit(f"{kind} copies", head_dim, grouped_copy_entries(head_dim, dtypes)))
    return [u for u in units if u.entries]


def grouped_copy_entries(head_dim: int, dtypes: tuple[str, ...] = GROUPED_DTYPES) -> list[table.Instantiation]:
    """The row copies of every grouped codec at ``head_dim`` (instantiations.copy_entries:
    codes as byte rows, scales as float rows), one entry per name; none where the head dim
    splits a block."""
    out: dict[str, table.Instantiation] = {}
    for kv in table.STORAGES["grouped"]:
        if table.block_rejection(kv, head_dim) is None:
            for t in dtypes:
                for e in table.copy_entries(t, head_dim, kv):
                    out.setdefault(e.name, e)
    return list(out.values())


def _flags(asan: bool, registration: Unit | None = None) -> list[str]:
    """g++ options for driver.cpp holding the kernels ``registration`` registers (one unit
    of ``registrations``; its code reaches driver.cpp as the file GQAKV_EMU_REGISTRATIONS)."""
    # The kernels' limits as -D options, as NVRTC gets them (sources.COMPILE_OPTIONS).
    flags = ["-std=c++20", "-pthread", "-shared", "-fPIC", f"-I{kernel_dir()}",
             f"-include{HERE / 'cuda_emu.h'}", *limits.define_options()]
    if registration is not None:
        flags.append(f'-DGQAKV_EMU_REGISTRATIONS="{_registration_file(registration)}"')
    if asan:
        # alignment too: a misaligned 16-byte load faults on a GPU but runs on x86; -g: the
        # reports name source lines
        flags += ["-g", "-O1", "-fsanitize=address,alignment", "-fno-sanitize-recover=alignment",
                  "-fno-omit-frame-pointer"]
    else:
        flags += ["-O2"]  # no -g: debug info is a quarter of the compile time, and no test reads it
    return flags


def _registration_file(registration: Unit) -> Path:
    """The unit's generated registration code (``Unit.code``), written once under the temp
    directory and named by its content (so the unit's cache key follows its entries)."""
    code = f"// generated by tests/cuda_emu/harness.py: {registration.label}\n{registration.code()}"
    path = _cache_dir() / f"registrations_{hashlib.sha256(code.encode()).hexdigest()[:16]}.inc"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(code)
        os.replace(tmp, path)
    return path


def _cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "gqakv_cuda_emu"


def _unit_path(asan: bool, registration: Unit, sources_digest: str) -> Path:
    digest = hashlib.sha256(sources_digest.encode())
    digest.update(" ".join([str(compiler()), *_flags(asan, registration)]).encode())
    tag = "asan" if asan else "opt"
    return _cache_dir() / f"libgqakv_emu_{tag}_{digest.hexdigest()[:16]}.so"


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for p in sorted(kernel_dir().glob("*.cu*")) + [HERE / "cuda_emu.h", HERE / "driver.cpp"]:
        digest.update(p.name.encode() + p.read_bytes())
    return digest.hexdigest()


def _units(asan: bool, head_dims: tuple[int, ...], families: tuple[str, ...],
           only_head_dim: int | None = None) -> list[Unit]:
    """What ``build`` compiles, one shared object each: the units of ``registrations``
    (only those of ``only_head_dim`` if given); for AddressSanitizer, joined into one unit
    per kind (each unit repeats the driver's and the kernels' parsing, which takes longest
    under ASan, and its library is only ever built whole)."""
    units = [u for u in registrations(head_dims, families)
             if only_head_dim is None or u.head_dim == only_head_dim]
    if not asan:
        return units
    groups: dict[str, list[table.Instantiation]] = {}
    for u in units:
        groups.setdefault(u.kind, []).extend(u.entries)
    return [Unit(kind, None, tuple(entries)) for kind, entries in groups.items()]


def library_paths(asan: bool, head_dims: tuple[int, ...] = HEAD_DIMS,
                  families: tuple[str, ...] = FAMILIES) -> tuple[Path, ...]:
    """The library's shared objects (one per unit ``build`` compiles), cached under the
    temp directory by a hash of the sources, the compiler and the flags."""
    sources_digest = _sources_digest()
    return tuple(_unit_path(asan, r, sources_digest) for r in _units(asan, head_dims, families))


def build(asan: bool = False, head_dims: tuple[int, ...] = HEAD_DIMS,
          families: tuple[str, ...] = FAMILIES, only_head_dim: int | None = None) -> tuple[Path, ...]:
    """Compile (once per source version, head-dim set and families) and return the
    library's shared objects (``Emulator`` loads them as one library); with
    ``only_head_dim``, only its units of that head dim (all a caller at that head dim
    launches). Units not yet on disk are compiled in parallel, ahead of any that
    ``prebuild`` queued."""
    return build_registrations(asan, _units(asan, head_dims, families, only_head_dim))


def prebuild(asan: bool = False, head_dims: tuple[int, ...] = HEAD_DIMS,
             families: tuple[str, ...] = FAMILIES) -> None:
    """Queue the library's missing units for compiling in the background (a later ``build``
    of it waits only for what is left); nothing without a compiler."""
    if compiler() is not None:
        build_registrations(asan, _units(asan, head_dims, families), wait=False)


def build_registrations(asan: bool, units: Sequence[Unit], wait: bool = True) -> tuple[Path, ...]:
    """The shared objects of build units ``units`` (as ``registrations`` gives them), compiled where missing: waited for, ahead of queued units
    (``wait``), or queued for the background (``wait=False``, what ``prebuild`` does)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    sources_digest = _sources_digest()
    jobs = [_builder.submit(_unit_path(asan, r, sources_digest),
                            [cxx, *_flags(asan, r), str(HERE / "driver.cpp")], urgent=wait)
            for r in units]
    if wait:
        for job in jobs:
            job.wait()
    return tuple(job.path for job in jobs)


def build_jobs() -> int:
    """Compilers run at once: GQAKV_EMU_BUILD_JOBS, else this process's CPUs (at most 8:
    each g++ of a unit takes up to about a GiB)."""
    env = os.environ.get("GQAKV_EMU_BUILD_JOBS")
    if env:
        return max(1, int(env))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, 8))


class _Job:
    """One unit's compile: ``path`` once done, or the compiler's error."""

    def __init__(self, path: Path, cmd: list[str], rank: tuple[int, int]):
        self.path, self.cmd, self.rank = path, cmd, rank
        self.done = threading.Event()
        self.error: str | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(self.error)


class _Builder:
    """Compiles units on up to ``build_jobs()`` threads, each running one g++: urgent units
    (a ``build`` waits for them) before queued ones (``prebuild``), each in submission order.
    A unit another process is compiling is waited for (a lock file beside it), not compiled
    twice. At exit the queue is dropped and running compilers are stopped."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._jobs: dict[Path, _Job] = {}
        self._queue: list[_Job] = []
        self._running: set[subprocess.Popen] = set()
        self._threads = 0
        self._seq = 0
        self._closed = False

    def submit(self, path: Path, cmd: list[str], urgent: bool) -> _Job:
        with self._cv:
            self._seq += 1
            rank = (0 if urgent else 1, self._seq)
            job = self._jobs.get(path)
            if job is None:
                job = self._jobs[path] = _Job(path, cmd, rank)
                if path.exists():
                    job.done.set()
                else:
                    self._queue.append(job)
            elif job in self._queue and rank < job.rank:
                job.rank = rank
            if self._queue and self._threads < build_jobs() and not self._closed:
                self._threads += 1
                threading.Thread(target=self._work, name="gqakv-emu-build", daemon=True).start()
            return job

    def _work(self) -> None:
        while True:
            with self._cv:
                if not self._queue or self._closed:
                    self._threads -= 1
                    return
                job = min(self._queue, key=lambda j: j.rank)
                self._queue.remove(job)
            try:
                self._compile(job)
            except Exception as exc:  # reported to every waiter of this unit
                job.error = str(exc)
            job.done.set()

    def _compile(self, job: _Job) -> None:
        out = job.path
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".lock"), "w") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if out.exists():  # another process built it meanwhile
                return
            tmp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            cmd = [*job.cmd, "-o", str(tmp)]
            if job.rank[0] == 1 and _NICE is not None:
                # queued ahead (no test waits for it yet): it takes only the CPU time the tests
                # leave, so a test in the meantime runs (and times itself) as if alone
                cmd = [_NICE, "-n", "10", *cmd]
            with self._cv:
                if self._closed:
                    raise RuntimeError("the emulation build stopped: the interpreter is exiting")
                # a session of its own: stopping it stops g++'s cc1plus and as too
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        start_new_session=hasattr(os, "killpg"))
                self._running.add(proc)
            try:
                _, stderr = proc.communicate()
            finally:
                with self._cv:
                    self._running.discard(proc)
            if proc.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"emulation build failed:\n{' '.join(cmd)}\n{stderr}")
            os.replace(tmp, out)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.error = "the emulation build stopped: the interpreter is exiting"
                job.done.set()
            self._queue.clear()
            for proc in self._running:
                try:
                    if hasattr(os, "killpg"):
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        proc.kill()
                except OSError:  # already gone
                    pass


_NICE = shutil.which("nice")
_builder = _Builder()
atexit.register(_builder.close)


class _Library:
    """A library's shared objects (``build``'s units) as one: ``emu_has_kernel`` asks every
    part; allocation and poisoning (process-wide: malloc, AddressSanitizer's shadow) go
    through the first. Each part holds the whole driver (its own registry and launch state,
    loaded RTLD_LOCAL so that no part binds another's)."""

    def __init__(self, paths: Sequence[Path]):
        c = ctypes
        self.parts = [c.CDLL(str(p)) for p in paths]
        for lib in self.parts:
            lib.emu_launch.argtypes = [c.c_char_p, c.POINTER(c.c_uint), c.POINTER(c.c_uint),
                                       c.POINTER(c.c_void_p), c.POINTER(c.c_size_t), c.c_int]
            lib.emu_has_kernel.argtypes = [c.c_char_p]
            lib.emu_kernel_names.argtypes = [c.c_char_p, c.c_size_t]
            lib.emu_kernel_names.restype = c.c_size_t
        first = self.parts[0]
        first.emu_alloc.restype = c.c_void_p
        first.emu_alloc.argtypes = [c.c_size_t]
        first.emu_free.argtypes = [c.c_void_p]
        first.emu_poison.argtypes = [c.c_void_p, c.c_size_t]
        first.emu_unpoison.argtypes = [c.c_void_p, c.c_size_t]
        self.emu_alloc, self.emu_free = first.emu_alloc, first.emu_free
        self.emu_poison, self.emu_unpoison = first.emu_poison, first.emu_unpoison
        self._owner: dict[bytes, ctypes.CDLL] = {}

    def part_of(self, name: bytes) -> ctypes.CDLL | None:
        """The part that instantiates kernel ``name`` (None: no part does)."""
        if name not in self._owner:
            lib = next((lib for lib in self.parts if lib.emu_has_kernel(name)), None)
            if lib is None:
                return None
            self._owner[name] = lib
        return self._owner[name]

    def kernel_names(self) -> list[list[str]]:
        """The kernel names each part registers (in ``parts`` order)."""
        out = []
        for lib in self.parts:
            buf = ctypes.create_string_buffer(lib.emu_kernel_names(None, 0) + 1)
            lib.emu_kernel_names(buf, len(buf))
            out.append(buf.value.decode().splitlines())
        return out

    def emu_has_kernel(self, name: bytes | str) -> int:
        return int(self.part_of(name.encode() if isinstance(name, str) else name) is not None)


class Emulator:
    def __init__(self, paths: Path | Sequence[Path]):
        """paths: ``build``'s shared objects (or one library's path)."""
        self.lib = _Library([paths] if isinstance(paths, (str, os.PathLike)) else list(paths))
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
            if name in arrays:  # the caller's (a planned batch's own workspaces)
                want = 4 * int(np.prod(shape))  # fp32
                if arrays[name].nbytes != want:
                    raise ValueError(f"workspace {name} has {arrays[name].nbytes} bytes, the plan "
                                     f"names {list(shape)} fp32 ({want})")
                continue
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
            elif isinstance(a, (planmod.KernelParams, planmod.PageTableArg)):
                # the plan's record of the struct (structs.py's dtype), as the kernels' struct:
                # the ctypes type generated from the same declaration, aligned like it
                rec = a.record(lambda buf: ptrs[buf.name])
                struct = structs.ATTN_PARAMS if isinstance(a, planmod.KernelParams) else structs.KV_PAGES
                holders.append(struct.ctypes_type().from_buffer_copy(rec.tobytes()))
            else:
                raise TypeError(f"{launch.name}: argument {a!r} has no explicit CUDA type")
        argv = (c.c_void_p * len(holders))(*[c.cast(c.pointer(h), c.c_void_p) for h in holders])
        sizes = (c.c_size_t * len(holders))(*[c.sizeof(h) for h in holders])
        grid = (c.c_uint * 3)(*launch.grid)
        block = (c.c_uint * 3)(*launch.block)
        name = launch.name.encode()
        part = self.lib.part_of(name)
        rc = 1 if part is None else part.emu_launch(name, grid, block, argv, sizes, len(holders))
        if rc == 1:
            raise KeyError(f"{launch.name} is not instantiated in the emulation library")
        if rc == 2:
            raise TypeError(f"{launch.name}: argument count or sizes do not match the kernel")
        if rc == 3:
            raise ValueError(f"{launch.name}: bad launch shape grid={launch.grid} block={launch.block}")
        self.launches += 1
