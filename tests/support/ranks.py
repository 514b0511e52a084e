"""Starting gloo worker processes on the loopback interface, bounded in time and killed on
failure (the multi-process tests' common part)."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(**extra) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def write_result(out: dict, outdir: str) -> None:
    with open(os.path.join(outdir, f"rank{out['rank']}.pkl"), "wb") as f:
        pickle.dump(out, f)


def run_group(module: str, world: int, outdir: Path, timeout_s: float) -> list[dict]:
    """``world`` processes of ``python -m module worker RANK WORLD OUTDIR``; all killed if
    any is late; each must write ``rankR.pkl`` without an ``"error"`` entry."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", module, "worker", str(r), str(world), str(outdir)],
                              cwd=ROOT, env=loopback_env(MASTER_PORT=port, RANK=r, WORLD_SIZE=world,
                                                         LOCAL_RANK=r),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout_s
    logs = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs.append(stdout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r in range(world):
        path = outdir / f"rank{r}.pkl"
        assert path.exists(), f"rank {r} wrote no result; output:\n" + "\n".join(logs)
        with open(path, "rb") as f:
            res = pickle.load(f)
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
        results.append(res)
    assert all(p.returncode == 0 for p in procs), logs
    return results
