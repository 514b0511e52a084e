"""Work done, counted rather than timed: the instructions and simulated last-level cache
misses of one fixed call per headline workload (decode in every storage kind the numba
kernels read, a chunked prefill, the NumPy reference's decode), under valgrind's
callgrind. See gqakv/tools/work_count.py for how, and docs/guides/performance.md
("Counting work") for why a CI should gate on these and not on the times.

The counts do not move with the machine's load: runs of one commit repeat instructions to
within 0.01%, so ``asv continuous -b track_instructions -f 1.02 BASE HEAD`` flags only a
change in the work a call does. Last-level misses are tracked beside them but move by up
to 5% with where arrays land: read them, do not gate on them. The harness is loaded by path from the working tree, so
older commits (which lack gqakv/tools/work_count.py) are counted the same way; a scenario
a commit cannot build is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

try:  # raised in a benchmark method, asv records "skipped" for that method only
    from asv_runner.benchmarks.mark import SkipNotImplemented
except ImportError:
    SkipNotImplemented = NotImplementedError


def _harness():
    """gqakv/tools/work_count.py of this working tree, imported by path."""
    path = Path(__file__).resolve().parents[2] / "gqakv" / "tools" / "work_count.py"
    spec = importlib.util.spec_from_file_location("gqakv_work_count_harness", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


HARNESS = _harness()


class Work:
    """Instructions and last-level misses of one call per scenario (``HARNESS.SCENARIOS``);
    all scenarios are counted in one valgrind process per commit (``setup_cache``)."""

    params = [list(HARNESS.SCENARIOS)]
    param_names = ["scenario"]
    rounds = 1  # a count repeats: a second round would only cost minutes
    repeat = 1
    number = 1
    timeout = 3600

    def setup_cache(self):
        missing = HARNESS.missing_tools()
        if missing:
            return {"missing": f"counting work needs {', '.join(missing)}"}
        return HARNESS.count_work(python=sys.executable)  # the commit's gqakv

    setup_cache.timeout = 3600

    def setup(self, counts, scenario):
        if "missing" in counts:
            raise NotImplementedError(counts["missing"])
        if "skipped" in counts[scenario]:
            raise NotImplementedError(counts[scenario]["skipped"])

    def track_instructions(self, counts, scenario):
        return counts[scenario]["instructions"]

    track_instructions.unit = "instructions"

    def track_ll_misses(self, counts, scenario):
        """Misses of the simulated 1 MiB last level: the call's memory traffic in 64-byte
        lines (its K/V are 16x that level)."""
        return counts[scenario]["ll_misses"]

    track_ll_misses.unit = "misses"
