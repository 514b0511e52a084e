"""The README's API example runs as written and does what its comments say."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_api_example_runs_and_holds_its_comments():
    block = next(b for b in _python_blocks() if "cache.append(k_new, v_new, n_new)" in b)
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)
    out, lse, cache = ns["out"], ns["lse"], ns["cache"]
    assert out.shape == (2, 32, 5, 128) and out.dtype == np.float32
    assert (out[1, :, 2:] == 0).all() and np.isneginf(lse[1, :, 2:]).all()
    assert list(cache.lens) == [5, 2]
