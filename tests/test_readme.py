"""Every ```python block of the README runs as written and does what its comments say.

Each block is one test (by index), run in a fresh namespace; a block added to the README
without an entry in BLOCKS fails ``test_every_block_has_a_check``. A line ``print(...)  #
prints TEXT`` must print exactly TEXT; each block's check asserts the rest of its claims.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
PRINTS = re.compile(r"^print\(.*\)\s+# prints (.*)$")


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _run(block: str, ns: dict | None = None) -> dict:
    """exec ``block`` in ``ns``; asserts every ``# prints`` comment against what it printed."""
    ns = {} if ns is None else ns
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), ns)
    expected = [m.group(1).rstrip() for line in block.splitlines() if (m := PRINTS.match(line.strip()))]
    assert out.getvalue().splitlines() == expected
    return ns


def check_api_example(block):
    ns = _run(block)
    out, lse, cache = ns["out"], ns["lse"], ns["cache"]
    assert out.shape == (2, 32, 5, 128) and out.dtype == np.float32
    assert (out[1, :, 2:] == 0).all() and np.isneginf(lse[1, :, 2:]).all()
    assert np.isfinite(out[0]).all() and np.isfinite(lse[:, :, :2]).all()
    assert list(cache.lens) == [5, 2]
    assert cache.k.shape == (2, 8, 4096, 128)


def check_model_cache_example(block):
    """Runs up to the beam step's reorder, checks the reorder moved every layer's live K/V
    as the comment says (beam b from parents[b]), then runs the rest."""
    head, tail = block.split("cache.reorder(parents)", 1)
    ns = _run(head)
    cache, parents = ns["cache"], ns["parents"]
    assert ns["logits"].shape == (4, 1, ns["vocab"])
    assert list(cache.host_lens) == [12] * 4  # fork copied the prompt, the beam step added one token
    before_k, before_v = cache.k[:, :, :, :12].copy(), cache.v[:, :, :, :12].copy()
    _run("cache.reorder(parents)" + tail, ns)
    for b, p in enumerate(parents):
        assert np.array_equal(cache.k[:, b, :, :12], before_k[:, p])
        assert np.array_equal(cache.v[:, b, :, :12], before_v[:, p])
    assert list(cache.host_lens) == [12, 14, 12, 0]


def check_transformers_example(block):
    torch = pytest.importorskip("torch", reason="torch not installed (pip install torch==2.13.0)")
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'gqakv[transformers]')")
    import transformers.models.llama  # noqa: F401  (imported here: seconds of import are not the block's)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: torch's spinning pool only slows it on a busy machine
    try:
        ns = _run(block)
    finally:
        torch.set_num_threads(threads)
    cache, out = ns["cache"], ns["out"]
    assert out.shape == (1, 6 + 8)  # the second generation, from a reset cache
    assert list(cache.kv_caches[0].host_lens[:1]) == [6 + 7]


# (a phrase only that block has, its check), in README order
BLOCKS = [
    ("cache.append(k_new, v_new, n_new)", check_api_example),
    ("gqakv.ModelKVCache(", check_model_cache_example),
    ("GqakvCache(model.config", check_transformers_example),
]


def test_every_block_has_a_check():
    blocks = _python_blocks()
    assert len(blocks) == len(BLOCKS), f"README has {len(blocks)} python blocks, BLOCKS lists {len(BLOCKS)}"
    for i, (block, (phrase, _)) in enumerate(zip(blocks, BLOCKS)):
        assert phrase in block, f"python block {i} does not contain {phrase!r}: update BLOCKS"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[check.__name__ for _, check in BLOCKS])
def test_readme_block(index):
    blocks = _python_blocks()
    if index >= len(blocks):
        pytest.fail(f"README has only {len(blocks)} python blocks")
    phrase, check = BLOCKS[index]
    assert phrase in blocks[index], f"python block {index} does not contain {phrase!r}: update BLOCKS"
    check(blocks[index])
