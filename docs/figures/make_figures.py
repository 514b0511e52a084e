"""Measure, then draw the documentation's figures (one script, no hand-drawn numbers).

    python docs/figures/make_figures.py              # measure on this machine, save, draw
    python docs/figures/make_figures.py --from-data  # redraw from docs/figures/data/*.json
    python docs/figures/make_figures.py --tiny --out /tmp/figs   # seconds: the tests' check
    python docs/figures/make_figures.py --max-load 2.5   # wait for a quiet machine before each point

Measuring runs ``gqakv bench --json`` once per (backend, dtype, cache length) in a fresh
process (a Llama-3.1-8B layer: Hq 32, Hkv 8, d 128; one row prefilled to the length, then
decode steps) and takes memory from ``gqakv.storage.sizing`` (the numbers ``gqakv size`` prints).
Every figure carries the machine, its load and the date of the measurement, from the data:
each point's run records the 1-minute load average just before and just after it and its
start time (UTC), and the stamp gives the first and last time and the range of those loads.
On the bandwidth figure a point measured while the load average exceeded the machine's
cores (other work competing for them) is drawn hollow. On a shared machine, ``--max-load``
waits before each point until the load average is at most that value.

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
            lengths=(256, 512, 1024, 2048, 4096, 8192, 16384), shape=(), steps=128, chunk=2048, repeats=2)
TINY = dict(backends=("numpy",), dtypes=("float32",), lengths=(16, 48),
            shape=("--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--no-bandwidth"), steps=2,
            chunk=16, in_process=True)

# The mix of rows for the memory figure: a chat, a few medium requests, one long document.
MEMORY_ROWS = (100, 700, 2_500, 9_000, 30_000, 100_000)
MEMORY_MODEL, MEMORY_MAX_LEN = "llama-3.1-8b", 131_072


def load_average() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else float("nan")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def wait_for_load(max_load: float | None, max_wait_s: float, poll_s: float = 10.0) -> float:
    """Sleep until the 1-minute load average is at most ``max_load`` (None: do not wait),
    at most ``max_wait_s`` seconds; returns the load average then (measured anyway)."""
    import time

    load, waited = load_average(), 0.0
    while max_load is not None and load > max_load and waited < max_wait_s:
        if waited == 0:
            print(f"  waiting for the load average ({load}) to fall to {max_load} ...", file=sys.stderr, flush=True)
        time.sleep(poll_s)
        waited += poll_s
        load = load_average()
    return load


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
    return {"cpu": cpu, "cores": os.cpu_count(), "load_avg_1min": round(load_average(), 1),
            "date": _now(), "python": platform.python_version()}


def bench_run(backend: str, dtype: str, length: int, plan: dict) -> dict:
    """One ``gqakv bench --json`` run in its own process (each measurement starts fresh):
    one row of ``length`` tokens."""
    cmd = [sys.executable, "-m", "gqakv", "bench", "--json", "--quiet", "--backend", backend,
           "--dtype", dtype, "--batch", "1", "--prompt-lens", str(length),
           "--chunk", str(min(plan["chunk"], length)), "--steps", str(plan["steps"]), *plan["shape"]]
    if plan.get("in_process"):  # the tests' tiny run: no process start-up
        import contextlib
        import io

        from gqakv.tools import cli

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            if cli.main(cmd[3:]) != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed")
        return json.loads(out.getvalue())
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def measure(plan: dict, max_load: float | None = None, max_wait_s: float = 1800.0) -> dict:
    runs = []
    started = _now()
    for backend in plan["backends"]:
        for dtype in plan["dtypes"]:
            for length in plan["lengths"]:
                # On a shared machine other load only slows a run down: keep the fastest
                # decode of the repeats. Each run saves its start time and the load average
                # just before and just after it.
                tries = []
                for _ in range(plan.get("repeats", 1)):
                    before = wait_for_load(max_load, max_wait_s)
                    date = _now()
                    print(f"bench {backend} {dtype} L={length} (load average {before})", file=sys.stderr, flush=True)
                    run = bench_run(backend, dtype, length, plan)
                    after = load_average()
                    run.update(date=date, load_before=before, load_after=after,
                               load_avg_1min=max(before, after))
                    tries.append(run)
                best = max(tries, key=lambda r: r["decode_bytes_per_s"])
                best["repeats"] = len(tries)
                best["loads_of_repeats"] = [[r["load_before"], r["load_after"]] for r in tries]
                runs.append(best)
    data = {"machine": machine(), "runs": runs, "memory": memory_table()}
    data["machine"]["started"] = started
    return data


def _run_load(run: dict) -> float:
    """The highest load average recorded around a run (older data: the one after it)."""
    return max(run.get("load_before", run["load_avg_1min"]), run.get("load_after", run["load_avg_1min"]))


def memory_table() -> dict:
    """Bytes of each storage choice for MEMORY_ROWS (what ``gqakv size --rows`` prints)."""
    from gqakv.storage import sizing

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
    if measured:
        loads = [v for r in data["runs"] if "load_avg_1min" in r
                 for v in (r.get("load_before", r["load_avg_1min"]), r.get("load_after", r["load_avg_1min"]))]
        loads = loads or [m["load_avg_1min"]]
        when = f"{m['started']} to {m['date']}" if m.get("started") else m["date"]
        what = (f"measured {when} on {m['cpu']} ({m['cores']} cores), gqakv {data.get('gqakv', '?')}\n"
                f"1-minute load average before/after each point: {min(loads):g} to {max(loads):g}")
    else:
        what = (f"computed {m['date']} by gqakv.storage.sizing (the numbers gqakv size prints), "
                f"gqakv {data.get('gqakv', '?')}")
    fig.text(0.01, 0.005, what, fontsize=7, color="0.35", va="bottom")


def _save(fig, data: dict, path: Path, *, measured: bool = True, bottom: float = 0.06) -> Path:
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
    cores = data["machine"].get("cores") or 1
    loaded = {(r["backend"], r["config"]["dtype"], r["config"]["prompt_lens"][0])
              for r in runs if _run_load(r) > cores}
    for (backend, dtype), points in sorted(series.items()):
        points.sort()
        line, = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        label=f"{backend}, {dtype}")
        busy = [p for p in points if (backend, dtype, p[0]) in loaded]
        if busy:  # hollow: other work was competing for the cores
            ax.plot([p[0] for p in busy], [p[1] for p in busy], linestyle="none", marker="o",
                    markersize=9, markerfacecolor="white", markeredgecolor=line.get_color())
    if loaded:
        ax.plot([], [], linestyle="none", marker="o", markerfacecolor="white", markeredgecolor="0.3",
                label=f"hollow: load average above the {cores} cores during the run")
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
    p.add_argument("--max-load", type=float, default=None, metavar="LOAD",
                   help="before each point, wait until the 1-minute load average is at most LOAD")
    p.add_argument("--max-wait", type=float, default=1800.0, metavar="S",
                   help="with --max-load: wait at most S seconds per point, then measure anyway "
                        "(the load is recorded either way; default 1800)")
    args = p.parse_args(argv)
    data_file = args.out / "data" / "figures.json"
    if args.from_data:
        data = json.loads(data_file.read_text())
    else:
        import gqakv

        data = measure(TINY if args.tiny else FULL, args.max_load, args.max_wait)
        data["gqakv"] = gqakv.__version__
        data_file.parent.mkdir(parents=True, exist_ok=True)
        data_file.write_text(json.dumps(data, indent=1) + "\n")
    for path in plot(data, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
