"""Work counted, not timed: the instructions and simulated cache misses of one fixed small
call per headline workload, under valgrind's callgrind.

Wall time on a shared machine moves 1.2-1.4x between rounds (the host's other tenants
move this VM's read bandwidth), so a benchmark gate on time flags unchanged code. The
counts here do not depend on the load: the same commit gives the same counts to within
a fraction of a percent, and a change that does more work (an extra pass over K) moves
them by about what it adds. asv tracks them beside the times (``asv_benchmarks/benchmarks/
work.py``); ``gqakv bench --count-work`` prints them.

How a count is taken (``count_work``):

1. a native warm-up process builds every scenario and calls it once, so the numba
   kernels are compiled into a numba cache of their own (``NUMBA_CACHE_DIR``);
2. one valgrind process (``callgrind``, instrumentation off until the region starts)
   builds every scenario again, calls it once uncounted (kernels load from that cache),
   then once inside ``gqakv_counted_region`` (counted_region.c, built on demand with the
   system C compiler), which zeroes the counters, counts the call and writes a dump;
3. the dumps are read back: instructions (``Ir``) and last-level misses (``ILmr + DLmr +
   DLmw``) of a fixed simulated cache, which for a call that streams K/V through a cache
   16x smaller than them is its memory traffic in 64-byte lines.

Gate on instructions: they repeat to within 0.01% across runs, commits and harness
changes. Last-level misses repeat exactly in one environment, but move by up to 5% when
the process's environment or unrelated code shifts where arrays land (measured: 3% and
5% on unchanged code between asv runs), and first-level misses by up to 10%, which is why
those are not reported.

What is held fixed so that counts repeat: one thread everywhere (gqakv, numba, OpenMP,
BLAS), ``PYTHONHASHSEED=0``, address-space randomization off (``setarch -R``), the
garbage collector off inside the region, the simulated cache geometry (``CACHE``, not
the host's), and the numba code target: valgrind executes no AVX-512, so the kernels are
compiled for Haswell (AVX2, FMA, F16C) in both processes (``NUMBA_CPU_NAME`` /
``NUMBA_CPU_FEATURES``; the same value in both is what lets the counted process load the
warm-up's cache) and OpenBLAS is told its Haswell kernels. Counts therefore measure
the work of the AVX2 build, not the exact instruction mix that runs natively on an
AVX-512 machine: a metric of work done, to compare commits, not a time.

This file is also loaded by path from the working tree by the asv benchmarks (to count
older commits, which lack it): it imports only the standard library and NumPy at the
top, and builds its scenarios from gqakv's public API (``get_backend``, ``KVCache``,
``PagedKVCache``, ``gqa_attention``), skipping a scenario an older commit cannot build.

Needs valgrind (with its headers, ``valgrind/callgrind.h``: Debian's ``valgrind``
package has both), ``setarch`` (util-linux) and a C compiler (``cc``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REGION_SOURCE = HERE / "counted_region.c"

# Llama-3.1-8B's heads (Hq 32, Hkv 8, d 128) at lengths small enough to count in seconds,
# long enough that K/V (16 MiB at B=2 x 1,024 float32) is 16x the simulated last level.
HQ, HKV, D = 32, 8, 128

# Simulated caches (size, associativity, line): fixed so counts do not follow the host.
CACHE = {"I1": (32768, 8, 64), "D1": (32768, 8, 64), "LL": (1 << 20, 16, 64)}

# Code target for the numba kernels, in both processes (see the module docstring).
NUMBA_TARGET = {"NUMBA_CPU_NAME": "haswell",
                "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,"
                                      "+fxsr,+lzcnt,+mmx,+movbe,+popcnt,+sse,+sse2,+sse3,"
                                      "+sse4.1,+sse4.2,+ssse3,+xsave"}

ONE_THREAD = {"GQAKV_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
              "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One fixed call: ``batch`` rows holding ``length`` tokens (the last ``n_new`` of them
    just appended) and attention of those ``n_new`` queries per row over them, with
    ``HQ`` / ``HKV`` heads of ``head_dim``.

    With ``layers``, the call is instead a ``ModelKVCache`` decode step of that many layers
    (each appends one token per row and attends) over rows of about ``length`` tokens,
    with the backend's kernels no-op'd: the host work of a step alone (validation,
    planning, dispatch), the deterministic companion of ``gqakv bench --host-time``."""

    backend: str
    batch: int = 2
    length: int = 1024
    n_new: int = 1
    dtype: str = "float32"
    kv_dtype: str | None = None
    page_size: int | None = None
    head_dim: int = D
    layers: int | None = None


# The headline workloads: decode in every storage kind the numba kernels read, a chunked
# prefill (the BLAS path), and the NumPy reference's decode.
SCENARIOS = {
    "decode-numba-float32": Scenario("numba"),
    "decode-numba-bfloat16": Scenario("numba", dtype="bfloat16"),
    "decode-numba-int8": Scenario("numba", dtype="bfloat16", kv_dtype="int8"),
    "decode-numba-int4_g32": Scenario("numba", dtype="bfloat16", kv_dtype="int4_g32"),
    "decode-numba-float32-paged16": Scenario("numba", page_size=16),
    "decode-numba-float32-paged256": Scenario("numba", page_size=256),
    "decode-numba-bfloat16-paged16": Scenario("numba", dtype="bfloat16", page_size=16),
    "prefill-numba-float32": Scenario("numba", batch=1, length=576, n_new=64),
    # the same in float16 (K/V blocks widened to float32 for the BLAS path's matmuls) and
    # over int8 codes (blocks dequantized to float32)
    "prefill-numba-float16": Scenario("numba", batch=1, length=576, n_new=64, dtype="float16"),
    "prefill-numba-int8": Scenario("numba", batch=1, length=576, n_new=64, kv_dtype="int8"),
    "decode-numpy-float32": Scenario("numpy"),
    # the host target's step (issue 26): 32 layers, B=8, Hkv=8, G=4, d=64, 16 live tokens
    "step-host-numba": Scenario("numba", batch=8, length=16, head_dim=64, layers=32),
}

EVENTS = ("instructions", "ll_misses")


class Skip(Exception):
    """A scenario this commit or machine cannot build (the reason is the message)."""


def build(s: Scenario):
    """``call()`` running the scenario's attention once, on a cache filled with fixed data.
    Raises Skip when this gqakv cannot build it."""
    import gqakv

    try:
        backend = gqakv.get_backend(s.backend)
    except Exception as exc:  # unknown, or cannot run here
        raise Skip(f"backend {s.backend}: {exc}") from None
    if s.layers is not None:
        return _host_step(gqakv, backend, s)
    extra: dict[str, Any] = {} if s.kv_dtype is None else {"kv_dtype": s.kv_dtype}
    cache: Any
    try:
        if s.page_size is not None:
            cache = gqakv.PagedKVCache(s.batch, HKV, s.length, s.head_dim, dtype=s.dtype,
                                       backend=backend, page_size=s.page_size, **extra)
        else:
            cache = gqakv.KVCache(s.batch, HKV, s.length, s.head_dim, dtype=s.dtype,
                                  backend=backend, **extra)
    except (TypeError, ValueError, AttributeError) as exc:  # an option this commit lacks
        raise Skip(f"{s}: {exc}") from None
    tensor = _random_tensors(backend, s)
    history = s.length - s.n_new
    if history:
        k = tensor(HKV, history)
        cache.append(k, tensor(HKV, history), np.full(s.batch, history, dtype=np.int64))
    n_new = np.full(s.batch, s.n_new, dtype=np.int64)
    cache.append(tensor(HKV, s.n_new), tensor(HKV, s.n_new), n_new)
    q = tensor(HQ, s.n_new)

    def call():
        gqakv.gqa_attention(q, cache, n_new)
        backend.synchronize()

    return call


def _random_tensors(backend, s: Scenario):
    """``tensor(heads, t)``: the backend's ``[s.batch, heads, t, s.head_dim]`` arrays of
    ``s.dtype``, drawn in turn from one fixed seed (the same data for every commit)."""
    rng = np.random.default_rng(0)

    def tensor(heads, t):
        x = rng.standard_normal((s.batch, heads, t, s.head_dim)).astype(np.float32)
        return backend.from_numpy(x, s.dtype)

    return tensor


def _host_step(gqakv, backend, s: Scenario):
    """``call()`` running one decode step of ``s.layers`` layers with no-op kernels."""
    try:
        from gqakv.tools.host_time import kernels_as_no_ops
    except ImportError:
        raise Skip("gqakv.tools.host_time does not exist in this commit (added later)") from None
    if not backend.kernel_entries():
        raise Skip(f"backend {s.backend} declares no kernel entries to no-op")
    # every call appends a token per row: room for the warm-up's call and the counted ones
    B, steps, layers = s.batch, 4, int(s.layers or 0)
    cache = gqakv.ModelKVCache(layers, B, HKV, s.length + steps, s.head_dim, dtype=s.dtype,
                               backend=backend)
    tensor = _random_tensors(backend, s)
    x = tensor(HKV, s.length - 1)
    with cache.step([s.length - 1] * B) as step:
        for layer in range(layers):
            step.write(layer, x, x)
    q, k = tensor(HQ, 1), tensor(HKV, 1)
    ones = [1] * B

    def call():
        with kernels_as_no_ops(backend), cache.step(ones) as step:
            for layer in range(layers):
                step.attend(layer, q, k, k)

    return call


def _region_library(cache_dir: Path) -> Path:
    """counted_region.c built into ``cache_dir`` (once per source text)."""
    source = REGION_SOURCE.read_bytes()
    lib = cache_dir / f"counted_region-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if not lib.exists():
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C compiler (cc or gcc) to build counted_region.c")
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        run = subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(tmp), str(REGION_SOURCE)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"building counted_region.c failed ({compiler}; is valgrind's "
                               f"header valgrind/callgrind.h installed?):\n{run.stderr}")
        tmp.replace(lib)
    return lib


def _compiler() -> str | None:
    """The C compiler that builds counted_region.c: ``$CC`` (default ``cc``), else gcc."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def missing_tools() -> list[str]:
    """What count_work needs and this machine lacks (empty when it can run)."""
    need = {"valgrind": "valgrind", "setarch": "setarch (util-linux)"}
    missing = [why for tool, why in need.items() if shutil.which(tool) is None]
    if _compiler() is None:
        missing.append("a C compiler (cc)")
    return missing


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gqakv" / "work_count"


def _environment(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(ONE_THREAD)
    env.update(NUMBA_TARGET)
    env["NUMBA_CACHE_DIR"] = str(cache_dir / "numba")
    # valgrind executes no AVX-512: OpenBLAS must not be told an AVX-512 core.
    env["OPENBLAS_CORETYPE"] = "Haswell"
    return env


def _valgrind_command(out_file: Path) -> list[str]:
    sim = [f"--{level}={size},{ways},{line}" for level, (size, ways, line) in CACHE.items()]
    return ["setarch", "-R", "valgrind", "--tool=callgrind", "--instr-atstart=no",
            "--cache-sim=yes", *sim, f"--callgrind-out-file={out_file}", "--quiet"]


def read_dump(path: Path) -> dict[str, int]:
    """``{instructions, ll_misses}`` from a callgrind dump's events and totals."""
    names, found = None, {}
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("totals:", "summary:")):  # callgrind writes totals (older: summary)
            key, _, values = line.partition(":")
            found[key] = [int(x) for x in values.split()]
    totals = found.get("totals", found.get("summary"))
    if names is None or totals is None:
        raise RuntimeError(f"{path}: no events / totals line (not a callgrind dump?)")
    ev = dict(zip(names, totals + [0] * (len(names) - len(totals))))
    return {"instructions": ev["Ir"],
            "ll_misses": ev.get("ILmr", 0) + ev.get("DLmr", 0) + ev.get("DLmw", 0)}


def _known(names) -> list[str]:
    """``names`` (scenario names), or ValueError naming those ``SCENARIOS`` lacks."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown} (known: {', '.join(SCENARIOS)})")
    return list(names)


def count_work(scenarios=None, *, python: str = sys.executable, cache_dir: Path | None = None,
               timeout: float = 1800) -> dict[str, dict]:
    """Count scenarios with the gqakv that ``python`` imports, in one counted process, in
    the order given. ``scenarios``: names from ``SCENARIOS`` (default: all of them) or a
    ``{name: Scenario}`` dict. A count depends a little on what ran before it in the
    process (NumPy decode counted alone: 13.11M instructions, after the other scenarios
    13.01M), so compare counts taken with the same list. Returns ``{name: {"instructions",
    "ll_misses"}}``, or ``{name: {"skipped": reason}}`` for one this gqakv cannot build.

    Raises ValueError for an unknown name, RuntimeError naming what this machine lacks
    (valgrind, setarch, a compiler) or what failed (the child's output)."""
    if scenarios is None:
        scenarios = dict(SCENARIOS)
    elif not isinstance(scenarios, dict):
        scenarios = {n: SCENARIOS[n] for n in _known(scenarios)}
    bad = [n for n, s in scenarios.items() if not isinstance(s, Scenario)]
    if bad:
        raise TypeError(f"scenarios {bad} are not Scenario objects")
    missing = missing_tools()
    if missing:
        raise RuntimeError(f"counting work needs {', '.join(missing)}")
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    lib = _region_library(cache_dir)
    env = _environment(cache_dir)
    # -P: the script's folder (gqakv/tools) must not shadow top-level modules
    script = [python, "-P", str(Path(__file__).resolve())]
    with tempfile.TemporaryDirectory(prefix="gqakv-work-") as tmp:
        spec, report = Path(tmp) / "scenarios.json", Path(tmp) / "report.json"
        spec.write_text(json.dumps({n: dataclasses.asdict(s) for n, s in scenarios.items()}))
        warm = subprocess.run([*script, "--warm", str(spec)], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if warm.returncode != 0:
            raise RuntimeError(f"the warm-up process failed:\n{warm.stdout}\n{warm.stderr}")
        out_file = Path(tmp) / "callgrind.out"
        counted = subprocess.run([*_valgrind_command(out_file), *script, "--count", str(spec),
                                  str(lib), str(report)], env=env, capture_output=True, text=True,
                                 timeout=timeout)
        if counted.returncode != 0:
            raise RuntimeError(f"the counted process failed:\n{counted.stdout}\n{counted.stderr}")
        done = json.loads(report.read_text())
        results = {}
        for name in scenarios:
            entry = done[name]
            if "skipped" in entry:
                results[name] = entry
            else:  # dumps are numbered in the order the regions ran, from 1
                results[name] = read_dump(out_file.with_name(f"{out_file.name}.{entry['dump']}"))
        return results


def _scenarios(spec: str) -> dict[str, Scenario]:
    return {n: Scenario(**fields) for n, fields in json.loads(Path(spec).read_text()).items()}


def _warm(spec: str) -> None:
    for scenario in _scenarios(spec).values():
        try:
            build(scenario)()
        except Skip:
            pass


def _count(spec: str, lib_path: str, report: str) -> None:
    lib = ctypes.CDLL(lib_path)
    region = ctypes.CFUNCTYPE(None)
    done: dict[str, dict[str, Any]] = {}
    dumps = 0
    for name, scenario in _scenarios(spec).items():
        try:
            call = build(scenario)
        except Skip as why:
            done[name] = {"skipped": str(why)}
            continue
        call()  # uncounted: kernels load from the warm-up's cache, buffers are touched
        gc.collect()
        gc.disable()
        lib.gqakv_counted_region(region(call))
        gc.enable()
        dumps += 1
        done[name] = {"dump": dumps}
    Path(report).write_text(json.dumps(done))


# -- the command (gqakv work) ---------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                        help="which to count (default: all): " + ", ".join(SCENARIOS))
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")


def run(args) -> int:
    _known(args.scenarios)  # before the machine's tools: a bad name is the user's first error
    missing = missing_tools()
    if missing:  # the machine's fault, not gqakv's: one error line, exit 2
        raise ValueError(f"counting work needs {', '.join(missing)} (on Debian: apt-get install "
                         f"valgrind util-linux gcc)")
    counts = count_work(args.scenarios or None)
    if args.json:
        print(json.dumps(counts, indent=2))
        return 0
    print("gqakv work: instructions and last-level misses of one call, counted under valgrind "
          f"(one thread; numba code for {NUMBA_TARGET['NUMBA_CPU_NAME']}; simulated LL "
          f"{CACHE['LL'][0] >> 10} KiB)")
    for name, c in counts.items():
        if "skipped" in c:
            print(f"  {name:32s} skipped: {c['skipped']}")
        else:
            print(f"  {name:32s} {c['instructions']:>14,} instructions {c['ll_misses']:>12,} LL misses")
    return 0


def main(argv=None) -> int:
    """The processes count_work starts (``--warm``, ``--count``); alone, counts everything."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", metavar="SCENARIOS_JSON", help="(internal) the warm-up process")
    parser.add_argument("--count", nargs=3, metavar=("SCENARIOS_JSON", "LIB", "REPORT"),
                        help="(internal) the counted process, run under valgrind")
    args = parser.parse_args(argv)
    if args.warm:
        _warm(args.warm)
    elif args.count:
        _count(*args.count)
    else:
        print(json.dumps(count_work(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
