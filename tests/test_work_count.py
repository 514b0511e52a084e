"""Work counted under valgrind (gqakv/tools/work_count.py, ``gqakv work``, asv ``Work``).

- a callgrind dump's totals are read into instructions and last-level misses;
- end to end on the NumPy backend (no kernel compile, so it takes seconds of valgrind):
  the counted region holds the attention call, not the set-up: a call that streams its
  K/V through the 1 MiB simulated last level misses at least once per 64-byte line of
  them, twice the keys cost about twice the work, and the same call counted twice in one
  process repeats its instructions;
- refusals: an unknown scenario, and a machine without valgrind (one error line, exit 2).
"""

from __future__ import annotations

import shutil

import pytest

from gqakv.tools import cli, work_count
from gqakv.tools.work_count import Scenario, count_work, read_dump

DUMP = """\
# callgrind format
version: 1
creator: callgrind-3.19.0
cmd:  python
events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
summary: 0
fl=(1) x.c
fn=(1) f
16 5 1 1 0 0 0 0 0 0
totals: 1000 300 200 7 40 9 3 20 5
"""


def test_a_dump_is_read_into_instructions_and_last_level_misses(tmp_path):
    path = tmp_path / "callgrind.out.1"
    path.write_text(DUMP)
    assert read_dump(path) == {"instructions": 1000, "ll_misses": 3 + 20 + 5}


def test_a_file_that_is_not_a_dump_is_refused(tmp_path):
    path = tmp_path / "callgrind.out.1"
    path.write_text("nothing here\n")
    with pytest.raises(RuntimeError, match="no events / totals line"):
        read_dump(path)


needs_valgrind = pytest.mark.skipif(bool(work_count.missing_tools()),
                                    reason=f"needs {', '.join(work_count.missing_tools())}")


@needs_valgrind
def test_counts_are_of_the_call_and_follow_its_work(tmp_path):
    short = Scenario("numpy", batch=1, length=512)
    counts = count_work({"short": short, "again": short,
                         "double": Scenario("numpy", batch=1, length=1024)}, cache_dir=tmp_path)
    kv_lines = {name: 2 * work_count.HKV * s.length * work_count.D * 4 // 64
                for name, s in {"short": short, "double": Scenario("numpy", length=1024)}.items()}
    # every K/V line passes through a last level 4x (short) / 8x (double) smaller than them
    assert counts["short"]["ll_misses"] >= kv_lines["short"]
    assert counts["double"]["ll_misses"] >= 2 * kv_lines["short"]
    # the same call, built again and counted again in the same process
    assert counts["again"]["instructions"] == pytest.approx(counts["short"]["instructions"], rel=0.01)
    # the set-up (imports, cache fill) is not counted: twice the keys, about twice the work
    ratio = counts["double"]["instructions"] / counts["short"]["instructions"]
    assert 1.6 < ratio < 2.2, counts


def test_unknown_scenarios_are_refused():
    with pytest.raises(ValueError, match="unknown scenarios \\['nope'\\]"):
        count_work(["nope"])


def test_the_command_names_what_the_machine_lacks(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert cli.main(["work"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "gqakv: error: counting work needs valgrind, setarch (util-linux), a C compiler" in err
