"""The type checker and the linter, as part of the test command: mypy over gqakv/ and
backends/ and ruff over every Python file of the project, both configured in pyproject.toml
([tool.mypy], [tool.ruff]); each test fails with the tool's own report."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` in the project root (where pyproject.toml is)."""
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: it is in the test extra (pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_mypy_is_clean() -> None:
    # Files, options and cache directory (.mypy_cache) come from pyproject.toml.
    proc = _run("mypy")
    assert proc.returncode == 0, f"mypy found errors:\n{proc.stdout}{proc.stderr}"


def test_ruff_is_clean() -> None:
    proc = _run("ruff", "check", "--no-cache", "--output-format", "concise")
    assert proc.returncode == 0, f"ruff found errors:\n{proc.stdout}{proc.stderr}"
