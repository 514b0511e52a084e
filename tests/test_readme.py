"""The README: short, its example runs as written, its commands are CI's, its links resolve.

Everything the README used to hold now lives in the documentation site (docs/), whose
examples and claims tests/test_docs.py runs: the API example's checks are in
docs/guides/rules.md, the model cache's (fork, beam reorder, truncate, reset) in
docs/guides/serving.md, the transformers example's in docs/guides/transformers.md (hidden
``invisible-code-block`` assertions beside each example). The README's ``gqakv bench``
sample output is checked against a real run by tests/test_bench.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from .support.docs import run_page

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_readme_example_runs_and_does_what_its_comments_say():
    """The ```python block runs as written (its ``# prints`` comments are its output), and
    the rest of its comments hold: shapes, padding gives 0, lengths, the allocation."""
    ns = run_page(README)
    assert ns["__examples_run__"] == len(re.findall(r"^```python$", README.read_text(), flags=re.M)) == 1
    out, cache = ns["out"], ns["cache"]
    assert out.shape == (2, 32, 5, 128) and (out[1, :, 2:] == 0).all()
    assert list(cache.host_lens) == [5, 2] and cache.k.shape == (2, 8, 4096, 128)


def test_readme_test_command_is_what_ci_runs():
    """The README's test command is exactly the last line of .ci/run."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in README.read_text()


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the docs"
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_readme_feature_table_links_every_guide():
    """A guide added to docs/guides without a row in the README's table fails here."""
    text = README.read_text()
    for guide in sorted((ROOT / "docs" / "guides").glob("*.md")):
        assert f"(docs/guides/{guide.name})" in text, f"README's feature table misses {guide.name}"
