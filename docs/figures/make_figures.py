"""Measure, then draw the documentation's figures (one script, no hand-drawn numbers).

    python docs/figures/make_figures.py              # measure on this machine, save, draw
    python docs/figures/make_figures.py --from-data  # redraw from docs/figures/data/*.json
    python docs/figures/make_figures.py --tiny --out /tmp/figs   # seconds: the tests' check

Measuring runs ``gqakv bench --json`` once per (backend, dtype, cache length) in a fresh
process (a Llama-3.1-8B layer: Hq 32, Hkv 8, d 128; one row prefilled to the length, then
decode steps) and takes memory from ``gqakv.sizing`` (the numbers ``gqakv size`` prints).
Every figure carries the machine, its load and the date of the measurement, from the data.

Figures (PNG, beside this script unless ``--out``):

- ``decode_bandwidth.png``: decode bandwidth (bytes of live K/V read per step / time)
  against cache length, per backend and dtype, with the machine's best measured read
  bandwidth as a line.
- ``cache_memory.png``: memory of contiguous, paged and 8-bit caches for a mix of row
  lengths (Llama-3.1-8B, all 32 layers).
- ``concat_bytes.png``: bytes a cache grown by concatenation copies against the bytes
  gqakv writes (each token once), from the same bench runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (backends, dtypes, cache lengths, bench's shape flags, decode steps)
FULL = dict(backends=("numpy", "numba"), dtypes=("float32", "bfloat16"),
            lengths=(512, 2048, 8192), shape=(), steps=128, chunk=2048, repeats=2)
TINY = dict(backends=("numpy",), dtypes=("float32",), lengths=(16, 48),
            shape=("--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--no-bandwidth"), steps=2,
            chunk=16, in_process=True)

# The mix of rows for the memory figure: a chat, a few medium requests, one long document.
MEMORY_ROWS = (100, 700, 2_500, 9_000, 30_000, 100_000)
MEMORY_MODEL, MEMORY_MAX_LEN = "llama-3.1-8b", 131_072


def machine() -> dict:
    """Where and when: CPU model, cores, load average, date (UTC)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"cpu": cpu, "cores": os.cpu_count(), "load_avg_1min": round(load, 1),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version()}


def bench_run(backend: str, dtype: str, length: int, plan: dict) -> dict:
    """One ``gqakv bench --json`` run in its own process (each measurement starts fresh):
    one row of ``length`` tokens."""
    cmd = [sys.executable, "-m", "gqakv", "bench", "--json", "--quiet", "--backend", backend,
           "--dtype", dtype, "--batch", "1", "--prompt-lens", str(length),
           "--chunk", str(min(plan["chunk"], length)), "--steps", str(plan["steps"]), *plan["shape"]]
    if plan.get("in_process"):  # the tests' tiny run: no process start-up
        import contextlib
        import io

        from gqakv import cli

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            if cli.main(cmd[3:]) != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed")
        return json.loads(out.getvalue())
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def measure(plan: dict) -> dict:
    runs = []
    for backend in plan["backends"]:
        for dtype in plan["dtypes"]:
            for length in plan["lengths"]:
                # On a shared machine other load only slows a run down: keep the fastest
                # decode of the repeats (each run's load average is saved with it).
                tries = []
                for _ in range(plan.get("repeats", 1)):
                    print(f"bench {backend} {dtype} L={length}", file=sys.stderr, flush=True)
                    tries.append(bench_run(backend, dtype, length, plan))
                    tries[-1]["load_avg_1min"] = machine()["load_avg_1min"]
                best = max(tries, key=lambda r: r["decode_bytes_per_s"])
                best["repeats"] = len(tries)
                runs.append(best)
    return {"machine": machine(), "runs": runs, "memory": memory_table()}


def memory_table() -> dict:
    """Bytes of each storage choice for MEMORY_ROWS (what ``gqakv size --rows`` prints)."""
    from gqakv import sizing

    rows = {}
    for label, kv_dtype in (("bfloat16", None), ("int8", "int8")):
        paged = sizing.paged_cache_bytes(MEMORY_MODEL, MEMORY_ROWS, max_len=MEMORY_MAX_LEN,
                                         kv_dtype=kv_dtype)
        rows[f"contiguous {label}"] = paged.contiguous_bytes
        rows[f"paged {label}"] = paged.total_bytes
        rows[f"live tokens {label}"] = paged.live_bytes
    return {"model": MEMORY_MODEL, "max_len": MEMORY_MAX_LEN, "row_lens": list(MEMORY_ROWS),
            "page_size": 16, "bytes": rows}


def _stamp(fig, data: dict, measured: bool = True) -> None:
    m = data["machine"]
    loads = [r["load_avg_1min"] for r in data["runs"] if "load_avg_1min" in r] or [m["load_avg_1min"]]
    what = (f"measured {m['date']} on {m['cpu']} ({m['cores']} cores, load average "
            f"{min(loads)}-{max(loads)})" if measured else
            f"computed {m['date']} by gqakv.sizing (the numbers gqakv size prints)")
    fig.text(0.01, 0.005, f"{what}, gqakv {data.get('gqakv', '?')}", fontsize=7, color="0.35")


def _save(fig, data: dict, path: Path, *, measured: bool = True, bottom: float = 0.03) -> Path:
    """Stamp ``fig`` (``_stamp``), leave ``bottom`` of its height for the stamp, write it
    to ``path`` and close it."""
    import matplotlib.pyplot as plt

    _stamp(fig, data, measured)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(data: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    runs = data["runs"]

    # 1. decode bandwidth against cache length
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in runs:
        key = (r["backend"], r["config"]["dtype"])
        series.setdefault(key, []).append((r["config"]["prompt_lens"][0],
                                           r["decode_bytes_per_s"] / 1e9))
    for (backend, dtype), points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                label=f"{backend}, {dtype}")
    best = [r["read_bandwidth"]["best"] / 1e9 for r in runs if r.get("read_bandwidth")]
    if best:
        best.sort()
        ax.axhline(best[len(best) // 2], color="k", linestyle="--", linewidth=1,
                   label=f"measured read bandwidth (median of {len(best)}: {best[len(best) // 2]:.1f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache length L (tokens, one row)")
    ax.set_ylabel("decode: GB/s of live K/V read")
    shape = runs[0]["config"]
    repeats = max(r.get("repeats", 1) for r in runs)
    ax.set_title(f"Decode bandwidth, Hq={shape['heads']} Hkv={shape['kv_heads']} d={shape['head_dim']}, "
                 f"{shape['steps']} steps" + (f", best of {repeats} runs" if repeats > 1 else ""))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, data, out / "decode_bandwidth.png"))

    # 2. memory of the storage choices
    mem = data["memory"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = list(mem["bytes"])
    values = [mem["bytes"][k] / 2**30 for k in labels]
    bars = ax.barh(labels, values, color=["C0" if "contiguous" in k else "C2" if "paged" in k
                                          else "0.6" for k in labels])
    ax.bar_label(bars, labels=[f"{v:.1f} GiB" for v in values], fontsize=8, padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("GiB of K/V (all layers)")
    ax.set_title(f"{mem['model']}: rows of {', '.join(f'{n:,}' for n in mem['row_lens'])} tokens,\n"
                 f"max_len {mem['max_len']:,}, pages of {mem['page_size']} tokens", fontsize=9)
    ax.set_xlim(right=max(values) * 1.2)
    written.append(_save(fig, data, out / "cache_memory.png", measured=False, bottom=0.04))

    # 3. concatenation's copies against gqakv's writes
    fig, ax = plt.subplots(figsize=(7, 4.2))
    first = sorted((r for r in runs if (r["backend"], r["config"]["dtype"]) == min(series)),
                   key=lambda r: r["config"]["prompt_lens"][0])
    lengths = [r["config"]["prompt_lens"][0] + r["config"]["steps"] for r in first]
    ax.plot(lengths, [r["concat_bytes"] for r in first], marker="o",
            label="copied by a cache grown by concatenation")
    ax.plot(lengths, [r["live_bytes"] for r in first], marker="s",
            label="written by gqakv (each token once; 0 bytes copied)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("final row length (prompt + decode steps)")
    ax.set_ylabel("bytes, one layer")
    ax.set_title(f"Bytes moved to build one row's cache ({first[0]['config']['dtype']})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    written.append(_save(fig, data, out / "concat_bytes.png"))
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from-data", action="store_true", help="redraw from the saved data")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, numpy only (seconds)")
    p.add_argument("--out", type=Path, default=HERE, help="folder for the PNGs and data")
    args = p.parse_args(argv)
    data_file = args.out / "data" / "figures.json"
    if args.from_data:
        data = json.loads(data_file.read_text())
    else:
        import gqakv

        data = measure(TINY if args.tiny else FULL)
        data["gqakv"] = gqakv.__version__
        data_file.parent.mkdir(parents=True, exist_ok=True)
        data_file.write_text(json.dumps(data, indent=1) + "\n")
    for path in plot(data, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
