"""The CLI's error contract: every user error is one line ``gqakv: error: ...`` on stderr
and exit status 2, nothing on stdout; ``--debug`` (anywhere on the line) adds the
traceback; a bug (any other exception) keeps its traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gqakv.tools import cli

SMALL = ["--batch", "2", "--prompt-lens", "5", "--steps", "1", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "8", "--no-bandwidth", "--quiet"]
CUPY_MISSING = "cupy" if any(b.name == "cupy" and b.unavailable_reason()
                             for b in __import__("gqakv").list_backends()) else None


def one_line_error(capsys, argv, monkeypatch=None, env=None):
    """Run the CLI; assert exit 2, nothing on stdout, exactly one stderr line; return it."""
    if env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("gqakv: error: "), lines[0]
    assert captured.out == "", captured.out
    return lines[0]


@pytest.mark.parametrize("argv, env, expected", [
    (["bench", "--backend", "nonsense", *SMALL], {}, "unknown backend 'nonsense' (registered:"),
    (["bench", *SMALL], {"GQAKV_BACKEND": "bogus"},
     "unknown backend 'bogus', chosen by GQAKV_BACKEND=bogus (registered:"),
    (["bench", "--backend", "numpy", *SMALL], {"GQAKV_NUM_THREADS": "0"}, "GQAKV_NUM_THREADS=0 must be >= 1"),
    (["bench", "--backend", "numpy", *SMALL], {"GQAKV_NUM_THREADS": "abc"},
     "GQAKV_NUM_THREADS='abc' is not an integer"),
    (["bench", "--backend", "numpy", "--prompt-lens", "99999999999", "--no-bandwidth", "--quiet"], {},
     "cannot allocate a KV cache of"),
    (["bench", "--prompt-lens", "-5"], {}, "--prompt-lens must be comma-separated ints >= 1, got '-5'"),
    (["bench", "--prompt-lens", "abc"], {}, "--prompt-lens must be comma-separated ints >= 1, got 'abc'"),
    (["bench", "--steps", "-1"], {}, "--steps must be >= 0, got -1"),
    (["generate", "--layers", "0"], {}, "--layers must be >= 1, got 0"),
    (["generate", "--vocab", "0"], {}, "--vocab must be >= 1, got 0"),
    (["generate", "--prefix-cache", "0"], {}, "--prefix-cache must be >= 1, got 0"),
    (["generate", "--backend", "nonsense"], {}, "unknown backend 'nonsense'"),
    (["size", "--budget", "1e400"], {}, "--budget"),  # OverflowError before; names the value
    (["size", "--budget", "12XB"], {}, "--budget: cannot read a byte count from '12XB'"),
    (["size", "--max-len", "0"], {}, "--max-len must be >= 1, got 0"),
    (["size", "no-such-model"], {}, "unknown model 'no-such-model'"),
    (["size", "/no/such/config.json"], {}, "cannot read the model config '/no/such/config.json'"),
    (["selftest", "--backend", "nonsense"], {}, "unknown backend 'nonsense'"),
    (["selftest", "--seed", "-1"], {}, "--seed must be >= 0, got -1"),
    # argparse's own usage errors, in the same one-line form
    (["bench", "--bogus"], {}, "unrecognized arguments: --bogus (see 'gqakv bench --help')"),
    (["bench", "--batch", "x"], {}, "argument --batch: invalid int value: 'x' (see 'gqakv bench --help')"),
    (["bench", "--dtype", "int8"], {}, "argument --dtype: invalid choice: 'int8'"),
    (["nosuchcommand"], {}, "argument {bench,info,size,generate,selftest,work}: invalid choice: 'nosuchcommand'"),
])
def test_user_error_is_one_line_and_exit_2(capsys, monkeypatch, argv, env, expected):
    line = one_line_error(capsys, argv, monkeypatch, env)
    assert expected in line, line
    if "--budget" in argv:
        assert line.startswith("gqakv: error: --budget") and argv[-1] in line


@pytest.mark.skipif(CUPY_MISSING is None, reason="cupy can run here")
@pytest.mark.parametrize("command", ["bench", "generate", "selftest"])
def test_cupy_without_cuda_is_one_line(capsys, command):
    line = one_line_error(capsys, [command, "--backend", "cupy"])
    assert "backend 'cupy'" in line and "cupy:" in line  # names the backend and its reason


def test_unknown_model_hint_names_what_exists(capsys):
    line = one_line_error(capsys, ["size", "no-such-model"])
    assert "--config" not in line  # gqakv size has no --config flag
    assert "llama-3.1-8b" in line and "config.json" in line


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(capsys, where):
    argv = ["bench", "--prompt-lens", "abc"]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "UsageError" in err
    assert err.splitlines()[-1] == "gqakv: error: --prompt-lens must be comma-separated ints >= 1, got 'abc'"


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Exceptions outside the user-error list (a bug) are not swallowed into one line."""
    from gqakv.tools import info

    def broken(args):
        raise RuntimeError("a bug")
    monkeypatch.setattr(info, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["info"])


def test_multiline_messages_become_one_line():
    exc = ValueError("no backend can serve dtype=x:\n  numpy: no\n  torch: no")
    assert cli.error_line(exc) == "gqakv: error: no backend can serve dtype=x:; numpy: no; torch: no"
    assert cli.error_line(KeyError("missing thing")) == "gqakv: error: missing thing"


def test_good_commands_still_exit_0(capsys):
    assert cli.main(["bench", "--backend", "numpy", *SMALL]) == 0
    assert cli.main(["--debug", "info"]) == 0
    assert cli.main(["size", "--debug"]) == 0
    out = capsys.readouterr().out
    assert "backend: numpy" in out and "auto/default choice" in out and "per token" in out


def test_console_script_one_line_and_status():
    """The installed command (python -m gqakv, as the console script runs cli.main)."""
    env = dict(os.environ, GQAKV_BACKEND="bogus")
    done = subprocess.run([sys.executable, "-m", "gqakv", "bench", *SMALL], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "gqakv: error: unknown backend 'bogus', chosen by GQAKV_BACKEND=bogus (registered: "
        + done.stderr.split("(registered: ", 1)[1].rstrip("\n")]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, expected", [
    (["generate", "--gguf", "/no/such/model.gguf"], "--gguf '/no/such/model.gguf': no such file"),
    (["generate", "--gguf", "/"], "--gguf '/' is not a file (a GGUF file is needed)"),
])
def test_generate_gguf_path_is_checked_first(capsys, argv, expected):
    """A missing or wrong --gguf file: one line, exit 2, before anything is read or printed."""
    pytest.importorskip("gguf", reason="gguf not installed (pip install gguf)")
    pytest.importorskip("tokenizers", reason="tokenizers not installed (pip install tokenizers)")
    assert one_line_error(capsys, argv) == f"gqakv: error: {expected}"


@pytest.mark.parametrize("flags, named", [
    (["--prompt", "Hello"], "--prompt needs"),
    (["--chat"], "--chat needs"),
    (["--prompt", "Hello", "--chat"], "--prompt and --chat need"),
    (["--compare-cache", "int8"], "--compare-cache needs"),
    (["--decode-blas-threads", "2"], "--decode-blas-threads needs"),
])
def test_generate_real_model_flags_without_a_model_are_refused(capsys, monkeypatch, flags, named):
    """--prompt/--chat/--compare-cache without --model/--gguf would be ignored while the
    random-weight demo runs for minutes: refused before any weight is drawn."""
    from gqakv_examples import generate

    drawn = []
    monkeypatch.setattr(generate, "LlamaModel", lambda *a, **k: drawn.append(1))
    line = one_line_error(capsys, ["generate", *flags])
    assert line.startswith(f"gqakv: error: {named} a real model: add --model smollm2-135m or --gguf PATH")
    assert not drawn


def test_selftest_compile_line_tells_numba_compiles_on_first_call(tmp_path):
    """numba builds nothing ahead, but compiles every kernel specialization on its first
    call and caches it on disk: the compile line says so (not "nothing to build ahead"),
    names the cache folder and whether it holds kernels yet."""
    pytest.importorskip("numba")
    from gqakv.tools import selftest
    from gqakv.dispatch.registry import get_backend
    from gqakv_backends.numba_backend import jit_note as _jit_note

    check = selftest._compile(get_backend("numba"), ["float32"], quick=True)
    assert "nothing to build ahead" not in check.note
    assert check.note.startswith("built on first call: numba compiles each kernel specialization")
    assert "caches it on disk (" in check.note and not check.required
    empty = _jit_note(tmp_path)
    assert f"({tmp_path})" in empty and "none cached there yet: this run compiles them" in empty
    for name in ("numba_kernels._attend-652.py311.nbi", "numba_kernels._decode-1.py311.nbi"):
        (tmp_path / name).write_text("")
    assert "2 kernel cache indexes found there" in _jit_note(tmp_path)


def test_generate_prefills_the_default_prompts_in_one_forward_call(capsys, monkeypatch):
    """Every prefill call reads all the weights once, so the cached run's time to first
    token must not pay for small chunks: with the defaults, the ragged prompts (up to
    --prompt-len 64) go in one forward call, as the uncached run feeds them; the header
    says so. An explicit small --chunk still splits them (and the header says what it costs)."""
    import numpy as np

    from gqakv_examples import llama

    calls = []
    real = llama.LlamaModel.forward

    def spy(self, tokens, n_new, cache, **kw):
        calls.append(np.asarray(n_new).tolist())
        return real(self, tokens, n_new, cache, **kw)

    monkeypatch.setattr(llama.LlamaModel, "forward", spy)
    base = ["generate", "--config", "tiny", "--backend", "numpy", "--no-baseline", "--new-tokens", "2"]
    assert cli.main(base) == 0
    prefill = [n for n in calls if len(n) == 4 and max(n) > 1]  # the 4-row run's prefill calls
    assert prefill == [[64, 48, 32, 16]], calls
    assert "prefill in one forward call (--chunk 512 covers the longest prompt)" in capsys.readouterr().out
    calls.clear()
    assert cli.main([*base, "--chunk", "32"]) == 0
    assert [n for n in calls if len(n) == 4 and max(n) > 1] == [[32, 32, 32, 16], [32, 16, 0, 0]]
    assert "prefill in 2 forward calls of up to 32 tokens per row" in capsys.readouterr().out
