"""Run the emulated-kernel scenarios in this process: ``python run_cases.py [--asan] [-k TEXT]``.

With --asan it loads the AddressSanitizer build and poisons every byte a kernel must not
touch; start it with LD_PRELOAD=<libasan.so> (tests/test_cupy_emulated.py does). Prints
one line per scenario and ends with 'N passed, N failed'; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_emu import cases, harness  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--asan", action="store_true")
    ap.add_argument("-k", default="", help="only scenarios whose name contains this")
    args = ap.parse_args(argv)
    emu = harness.Emulator(harness.build(asan=args.asan))
    passed = failed = 0
    t_all = time.perf_counter()
    for case in cases.all_cases():
        if args.k not in case.name:
            continue
        t0 = time.perf_counter()
        try:
            stats = cases.run_any(emu, case, poison=args.asan)
        except AssertionError as exc:
            failed += 1
            print(f"FAIL {case.name}: {exc}", flush=True)
            continue
        passed += 1
        print(f"ok   {case.name} ({stats['steps']} steps, splits={stats['splits']}, "
              f"{time.perf_counter() - t0:.2f}s)", flush=True)
    print(f"{emu.launches} launches in {time.perf_counter() - t_all:.1f}s")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
