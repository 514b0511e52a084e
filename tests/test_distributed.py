"""Tensor parallelism (``gqakv.distributed``) with real processes on this machine.

One set of 4 gloo processes on the loopback interface (127.0.0.1, a free port, bounded
in time, killed on failure) runs every multi-process check, because each process pays
the torch import (seconds on a loaded CI box): groups of 2 (ranks 0-1 and 2-3 side by
side) and the group of all 4. Each rank writes what it saw to a file; the tests here
compare it with one process of the same model (NumPy, float64):

- greedy generation through contiguous, paged and int8-quantized caches: the same
  tokens, float64 logits within 1e-10 (the sharded math is one process's up to the
  order of the all-reduce's sums). int8 caches need a float32 model: there the
  difference must be float32 rounding, at most 4x the float32 model's own error
  against float64 + 1e-6 (the quantization error itself is ~4e-2, so a changed
  quantization would show);
- P = 2 with Hkv = 2 (one KV head per rank) and Hkv = 4 (two), P = 4 with Hkv = 2 (each
  KV head replicated on 2 ranks) and Hkv = 4; windows, soft-cap and sinks;
- a rank that raises mid-step (inside layer 1's attention), hands the all-reduce a
  partial sum of the wrong shape (layer 1's output projection one column too wide), or
  raises after the last all-reduce (in the logits), leaves every rank's lengths, pages
  and live K/V bytes unchanged and every rank raises TensorParallelError naming it
  (not a timeout); the next step works;
- bad splits raise before anything is allocated.

``torchrun`` itself runs ``python -m gqakv generate --tensor-parallel 2`` once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gqakv.storage import sizing
from gqakv.tools.cli import main as cli_main
from gqakv.distributed import HeadShard, even_slice
from gqakv_examples.llama import TINY, LlamaModel, generate
from tests.support.ranks import loopback_env, run_group, write_result

ROOT = Path(__file__).resolve().parents[1]
F64_ATOL = 1e-10
PROMPTS = [[5, 17, 3, 88, 42, 9, 61, 2, 30, 77, 14], [8, 1], [64, 23, 23, 5, 90, 11, 46], [33]]
CHUNKS = [3, 1, 5, 2]
NEW_TOKENS = 5
WORKER_TIMEOUT_S = 240  # the whole 4-process run; each collective is bounded by 60 s
DEAD_PEER_TIMEOUT_S = 20  # the group whose rank 3 dies
TP_VARIANT = dict(n_kv_heads=4, sliding_window=4, global_every=2, softcap=3.0, sinks=True)

# name -> (ranks of the group, LlamaConfig changes, cache options[, gqakv backend of the ranks])
SCENARIOS = {
    "p2-contiguous": ((0, 1), {}, {}),
    "p2-paged": ((2, 3), {}, {"page_size": 4}),
    "p2-variants": ((0, 1), TP_VARIANT, {}),  # 2 KV heads per rank
    "p2-torch-paged": ((2, 3), {}, {"page_size": 4}, "torch"),  # torch tensors all-reduced as they are
    "p4-replicated": ((0, 1, 2, 3), {}, {}),
    "p4-variants-int8": ((0, 1, 2, 3), TP_VARIANT, {"kv_dtype": "int8"}),
    "p4-variants-paged-int8": ((0, 1, 2, 3), TP_VARIANT, {"page_size": 3, "kv_dtype": "int8"}),
}

FAILURE_SCENARIOS = ["p2-contiguous", "p2-paged", "p4-replicated", "p2-torch-paged"]
# (where, the failing rank within the group); what the failing rank's message says of its error
FAILURES = (("mid-step", 1), ("wrong-shape", 1), ("after-last-all-reduce", 0))
OWN_ERROR = {"mid-step": "injected failure", "wrong-shape": "shape",
             "after-last-all-reduce": "injected failure"}

torch = pytest.importorskip("torch", reason="gqakv.distributed needs torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch has no gloo backend", allow_module_level=True)


def _dtype_for(cache_options):
    return "float32" if "kv_dtype" in cache_options else "float64"


# -- what every worker process runs -----------------------------------------------------------


def _snapshot(cache):
    """Lengths, pages held and every live K/V byte of every layer and row."""
    kv = []
    for layer in range(cache.layers):
        for row in range(cache.batch):
            k, v = cache.live_kv(layer, row)
            kv.append((cache.backend.to_numpy(k).tobytes(), cache.backend.to_numpy(v).tobytes()))
    pages = cache.pages_used if cache.store.kind == "paged" else None
    return cache.host_lens.tolist(), pages, kv


def _failure_checks(tp, group, model, out, cache_options):
    """Fail on one rank mid-step and at the end of the step; record what every rank saw."""
    from gqakv import distributed
    from gqakv.caches.model_cache import Step

    cache = model.new_cache(len(PROMPTS), 16, **cache_options)
    first = np.array([[p[0], p[1] if len(p) > 1 else 0] for p in PROMPTS])
    model.forward(first, [2, 1, 2, 1], cache)
    before = _snapshot(cache)
    step_tokens = np.array([[3, 4], [5, 6], [7, 8], [9, 10]])
    results = {}
    real_attend, real_logits = Step.attend, model._logits

    def attend_failing_in_layer_1(self, layer, *args, **kwargs):
        if layer == 1:
            raise ValueError("injected failure in layer 1's attention")
        return real_attend(self, layer, *args, **kwargs)

    def logits_failing(*args):
        raise RuntimeError("injected failure in the logits")

    real_wo = model.layers[1]["wo"]
    wide_wo = model.backend.from_numpy(  # its partial sum is [B, T, D + 1]: not the reduced shape
        np.zeros((int(real_wo.shape[0]), model.config.hidden_size + 1)), model.dtype)

    for where, rank in FAILURES:  # ranks within the group
        if where == "mid-step" and tp.rank == rank:
            Step.attend = attend_failing_in_layer_1
        if where == "wrong-shape" and tp.rank == rank:
            model.layers[1]["wo"] = wide_wo
        if where == "after-last-all-reduce" and tp.rank == rank:
            model._logits = logits_failing
        try:
            model.forward(step_tokens, [2, 2, 1, 0], cache)
            results[where] = ("no error", None, None)
        except distributed.TensorParallelError as exc:
            results[where] = (str(exc), exc.failed_ranks, _snapshot(cache) == before)
        finally:
            Step.attend, model._logits = real_attend, real_logits
            model.layers[1]["wo"] = real_wo
        results[where + ": open step"] = cache._open_step is not None
    # The cache still works: the same step now succeeds on every rank.
    results["after"] = model.forward(step_tokens, [2, 2, 1, 0], cache)
    results["lens after"] = cache.host_lens.tolist()
    out["failures"] = results


def _dead_peer_check(tp, rank: int, out: dict, outdir: str) -> None:
    """Ranks 2 and 3 prefill together; then rank 3's process ends and rank 2's next step
    must raise within the group's timeout, its cache unchanged."""
    model = LlamaModel(TINY, seed=3, dtype="float64", backend="numpy", tensor_parallel=tp)
    cache = model.new_cache(len(PROMPTS), 16, page_size=4)
    model.forward(np.array([[p[0]] for p in PROMPTS]), [1, 1, 1, 1], cache)
    if rank == 3:
        write_result(out, outdir)
        os._exit(0)  # dies without a word to its peer
    before = _snapshot(cache)
    t0 = time.monotonic()
    try:
        model.forward(np.array([[1], [2], [3], [4]]), [1, 1, 1, 1], cache)
        out["dead peer"] = ("no error", None, None, None)
    except Exception as exc:
        out["dead peer"] = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0,
                            _snapshot(cache) == before, cache._open_step is None)


def _worker(rank: int, world: int, outdir: str) -> None:
    import datetime

    import torch.distributed as dist

    from gqakv import distributed

    out = {"rank": rank}
    try:
        tp_world = distributed.init(world, timeout_s=60)
        assert tp_world.comm_backend == "gloo"
        try:
            distributed.init(world + 1)
        except ValueError as exc:
            out["init mismatch"] = str(exc)
        groups = {}
        for ranks in sorted({s[0] for s in SCENARIOS.values()}):
            # every rank creates every group, in the same order (torch's rule)
            groups[ranks] = dist.new_group(list(ranks)) if len(ranks) < world else None
        dying = dist.new_group([2, 3], timeout=datetime.timedelta(seconds=DEAD_PEER_TIMEOUT_S))
        for name, (ranks, changes, cache_options, *backend) in SCENARIOS.items():
            if rank not in ranks:
                continue
            tp = distributed.TensorParallel(groups[ranks])
            model = LlamaModel(TINY.replace(**changes), seed=3, dtype=_dtype_for(cache_options),
                               backend=(backend or ["numpy"])[0], tensor_parallel=tp)
            assert model.backend.name == (backend or ["numpy"])[0]
            g = generate(model, PROMPTS, NEW_TOKENS, chunks=CHUNKS, cache_options=cache_options)
            cache = model.new_cache(len(PROMPTS), 20, **cache_options)
            out[name] = {"tokens": g.tokens, "logits": g.logits, "shard": model.shard,
                         "cache_kv_heads": cache.kv_heads, "cache_nbytes": cache.nbytes,
                         "world_size": tp.world_size, "rank": tp.rank}
            if name in FAILURE_SCENARIOS:
                _failure_checks(tp, groups[ranks], model, out[name], cache_options)
        dist.barrier()
        if rank in (2, 3):
            _dead_peer_check(distributed.TensorParallel(dying), rank, out, outdir)
    except BaseException:
        import traceback

        out["error"] = traceback.format_exc()
    write_result(out, outdir)
    os._exit(0)  # no teardown handshake with a peer that is gone


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_group("tests.test_distributed", 4, tmp_path_factory.mktemp("tp"), WORKER_TIMEOUT_S)


def _float32_error(changes) -> float:
    """Max |logits| error of the float32 model (unquantized cache) against float64."""
    got, want = (generate(LlamaModel(TINY.replace(**changes), seed=3, dtype=dtype, backend="numpy"),
                          PROMPTS, NEW_TOKENS, chunks=CHUNKS) for dtype in ("float32", "float64"))
    return float(np.max(np.abs(got.logits - want.logits)))


def _one_process(name):  # always NumPy: the torch ranks are checked against it too
    _, changes, cache_options = SCENARIOS[name][:3]
    model = LlamaModel(TINY.replace(**changes), seed=3, dtype=_dtype_for(cache_options), backend="numpy")
    return model, generate(model, PROMPTS, NEW_TOKENS, chunks=CHUNKS, cache_options=cache_options)


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_tensor_parallel_generation_equals_one_process(ranks, name):
    group, changes, cache_options = SCENARIOS[name][:3]
    model, want = _one_process(name)
    assert len(np.unique(want.tokens)) > 4  # a degenerate model would prove little
    for r in group:
        got = ranks[r][name]
        assert got["world_size"] == len(group)
        np.testing.assert_array_equal(got["tokens"], want.tokens)
        if _dtype_for(cache_options) == "float64":
            np.testing.assert_allclose(got["logits"], want.logits, rtol=0, atol=F64_ATOL)
        else:
            err = np.max(np.abs(got["logits"] - want.logits))
            assert err <= 4 * _float32_error(changes) + 1e-6, err
        shard = got["shard"]
        assert shard == HeadShard.plan(model.config.n_heads, model.config.n_kv_heads, len(group), got["rank"])
        # The rank's cache holds its own KV heads only, as sizing's per-device count says.
        assert got["cache_kv_heads"] == shard.local_kv_heads
        per_device = sizing.ModelConfig("tiny", model.config.n_layers, model.config.n_heads,
                                        model.config.n_kv_heads, model.config.head_dim, 0)
        per_device = per_device.per_device(len(group))
        if "page_size" not in cache_options:
            assert got["cache_nbytes"] == sizing.cache_bytes(per_device, max_len=20, batch=len(PROMPTS),
                                                             dtype=_dtype_for(cache_options),
                                                             kv_dtype=cache_options.get("kv_dtype"))


def test_quantized_logits_are_not_those_of_float32(ranks):
    """The int8 scenarios really quantize: their logits differ from a float32 cache's."""
    model = LlamaModel(TINY.replace(**TP_VARIANT), seed=3, dtype="float32", backend="numpy")
    plain = generate(model, PROMPTS, NEW_TOKENS, chunks=CHUNKS)
    assert np.max(np.abs(ranks[0]["p4-variants-int8"]["logits"] - plain.logits)) > 1e-4


def test_replication_rule_when_ranks_outnumber_kv_heads(ranks):
    # TINY: Hq = 8, Hkv = 2 over 4 ranks: KV head r // 2, query heads 2r, 2r + 1.
    shards = [ranks[r]["p4-replicated"]["shard"] for r in range(4)]
    assert [(s.kv_start, s.kv_stop) for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [(s.q_start, s.q_stop) for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert {s.replicas for s in shards} == {2}


@pytest.mark.parametrize("name", FAILURE_SCENARIOS)
def test_a_failing_rank_aborts_the_step_on_every_rank(ranks, name):
    group = SCENARIOS[name][0]
    for where, culprit_index in FAILURES:
        culprit = group[culprit_index]
        for r in group:
            message, failed, unchanged = ranks[r][name]["failures"][where]
            local = ranks[r][name]["rank"]
            culprit_local = group.index(culprit)
            assert failed == (culprit_local,), (r, where, message)
            assert f"rank(s) {culprit_local} raised" in message and "aborted" in message
            assert unchanged is True, f"rank {r}: cache changed by the aborted step ({where})"
            assert ranks[r][name]["failures"][where + ": open step"] is False
            if local == culprit_local:
                assert OWN_ERROR[where] in message.split("; here: ")[1], message
    # The same step afterwards succeeds everywhere, from the unchanged cache.
    model, _ = _one_process(name)
    cache = model.new_cache(len(PROMPTS), 16, **SCENARIOS[name][2])
    first = np.array([[p[0], p[1] if len(p) > 1 else 0] for p in PROMPTS])
    model.forward(first, [2, 1, 2, 1], cache)
    want = model.forward(np.array([[3, 4], [5, 6], [7, 8], [9, 10]]), [2, 2, 1, 0], cache)
    for r in group:
        assert ranks[r][name]["failures"]["lens after"] == cache.host_lens.tolist() == [4, 3, 3, 1]
        np.testing.assert_allclose(ranks[r][name]["failures"]["after"], want, rtol=0, atol=F64_ATOL)


def test_a_dead_rank_makes_its_peer_raise_within_the_timeout(ranks):
    message, seconds, unchanged, closed = ranks[2]["dead peer"]
    assert message != "no error" and seconds is not None
    assert seconds < DEAD_PEER_TIMEOUT_S + 10, (seconds, message)
    assert unchanged is True and closed is True, message


def test_init_refuses_a_size_that_is_not_the_groups(ranks):
    assert "tensor parallel size 5 does not match the process group's 4 ranks" in ranks[0]["init mismatch"]


# -- the split, without processes ----------------------------------------------------------------


@pytest.mark.parametrize("hq, hkv, world, match", [
    (32, 8, 3, r"world_size=3 cannot split n_kv_heads=8: it must divide the KV heads .* or be a multiple"),
    (32, 8, 12, r"world_size=12 cannot split n_kv_heads=8"),
    (12, 4, 8, r"n_heads=12 must be a multiple of world_size=8"),
    (8, 3, 1, r"n_heads=8 must be a multiple of n_kv_heads=3"),
    (8, 2, 0, r"world_size must be >= 1, got 0"),
])
def test_bad_splits_are_refused(hq, hkv, world, match):
    with pytest.raises(ValueError, match=match):
        HeadShard.plan(hq, hkv, world)


def test_split_rules():
    shards = [HeadShard.plan(32, 8, 4, r) for r in range(4)]  # 2 KV heads, 8 query heads each
    assert [(s.kv_start, s.kv_stop, s.q_start, s.q_stop) for s in shards] == \
        [(0, 2, 0, 8), (2, 4, 8, 16), (4, 6, 16, 24), (6, 8, 24, 32)]
    s = HeadShard.plan(64, 8, 16, 5)  # 70B on 16: KV head 2 on ranks 4, 5; rank 5 its 2nd half
    assert (s.kv_start, s.kv_stop, s.q_start, s.q_stop, s.replicas) == (2, 3, 20, 24, 2)
    with pytest.raises(ValueError, match="rank=4 is out of range for world_size=4"):
        HeadShard.plan(32, 8, 4, 4)
    with pytest.raises(ValueError, match="intermediate_size=64 is not divisible by world_size=3"):
        even_slice(64, 3, 0, "intermediate_size")
    assert even_slice(64, 4, 3) == slice(48, 64)
    with pytest.raises(ValueError, match="rank=4 is out of range for world_size=4"):
        even_slice(64, 4, 4)  # was slice(64, 80): an empty share, no error
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        even_slice(64, 4, -1)


@pytest.mark.parametrize("kwargs, match", [
    ({"device_kind": "gpu"}, "device_kind='gpu' must be 'cpu' or 'cuda'"),
    ({"timeout_s": True}, "timeout_s=True must be a finite number of seconds > 0"),
    ({"timeout_s": float("inf")}, "timeout_s=inf must be"),
    ({"world_size": 0}, "world_size must be >= 1, got 0"),
])
def test_init_refuses_bad_arguments_before_joining(kwargs, match):
    from gqakv import distributed

    with pytest.raises(ValueError, match=match):
        distributed.init(**kwargs)
    assert not torch.distributed.is_initialized()


def test_model_refuses_a_bad_split_before_drawing():
    class FakeGroup:  # what LlamaModel asks of a TensorParallel before any communication
        world_size, rank = 3, 0

        def heads(self, hq, hkv):
            return HeadShard.plan(hq, hkv, self.world_size, self.rank)

        def columns(self, n, what):
            return even_slice(n, self.world_size, self.rank, what)

    with pytest.raises(ValueError, match="world_size=3 cannot split n_kv_heads=2"):
        LlamaModel(TINY, tensor_parallel=FakeGroup())
    with pytest.raises(ValueError, match="intermediate_size=64 is not divisible by world_size=3"):
        LlamaModel(TINY.replace(n_heads=6, n_kv_heads=3), tensor_parallel=FakeGroup())


# -- the commands ---------------------------------------------------------------------------------


def test_size_command_per_device(capsys):
    assert cli_main(["size", "llama-3.1-8b", "--tensor-parallel", "2", "--max-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "2 devices, each holding 4 of 8 KV heads and 16 of 32 query heads" in out
    assert "per token : 65,536 bytes" in out and "268,435,456 bytes (256.0 MiB) for batch 1" in out
    assert "16,384 bytes per token and layer, 524,288 (512.0 KiB) over 32 layers" in out
    assert "(512x the all-reduced bytes)" in out
    # 70B on 16 devices: one KV head each (replicated twice): 1/8 of the cache per device.
    assert cli_main(["size", "llama-3.1-70b", "--tensor-parallel", "16", "--budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    full = sizing.get_preset("llama-3.1-70b").bytes_per_token("bfloat16")
    assert f"per token : {full // 8:,} bytes" in out and "replicated on 2 devices" in out
    assert f"largest batch at max_len 4,096: {80 * 2**30 // (4096 * full // 8):,}" in out
    assert cli_main(["size", "llama-3.1-8b", "--tensor-parallel", "3"]) == 2
    err = capsys.readouterr().err
    assert "gqakv: error: --tensor-parallel 3: world_size=3 cannot split n_kv_heads=8" in err


def test_traffic_numbers():
    t = sizing.tensor_parallel_traffic("llama-3.1-8b", 2, context=4096)
    assert (t.all_reduce_bytes, t.ring_send_bytes, t.kv_read_bytes) == (16_384, 16_384, 4096 * 2 * 4 * 128 * 2)
    t = sizing.tensor_parallel_traffic("llama-3.1-70b", 8, context=4096)
    assert t.per_token["all_reduce_bytes"] == 80 * 2 * 8192 * 2
    assert t.ring_send_bytes == 2 * 32_768 * 7 // 8
    # A config.json whose hidden size is not Hq x d (Gemma 2 9B: 3,584 against 16 x 256):
    # the all-reduce carries the hidden size.
    gemma = sizing.config_from_hf({"num_hidden_layers": 42, "num_attention_heads": 16,
                                   "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584})
    t = sizing.tensor_parallel_traffic(gemma, 2, context=16)
    assert (t.hidden_size, t.all_reduce_bytes) == (3584, 2 * 3584 * 2)
    assert t.kv_read_bytes == 16 * 2 * 4 * 256 * 2
    assert sizing.tensor_parallel_traffic(gemma, 2, context=16, hidden_size=100).all_reduce_bytes == 400


@pytest.mark.parametrize("argv, match", [
    (["--tensor-parallel", "3"], "--tensor-parallel 3: world_size=3 cannot split n_kv_heads=2"),
    (["--tensor-parallel", "0"], "--tensor-parallel must be >= 1, got 0"),
    (["--tensor-parallel", "2"], "tensor parallel size 2 needs 2 processes started by a launcher, "
                                 "e.g. torchrun --nproc-per-node 2 -m gqakv generate --tensor-parallel 2"),
    (["--tensor-parallel", "2", "--tp-timeout", "0"], "--tp-timeout must be a finite number of seconds > 0, got 0.0"),
    (["--tensor-parallel", "2", "--tp-timeout", "inf"], "--tp-timeout must be a finite number of seconds > 0, got inf"),
    (["--tensor-parallel", "2", "--tp-timeout", "nan"], "--tp-timeout must be a finite number of seconds > 0, got nan"),
    (["--tensor-parallel", "2", "--model", "smollm2-135m"], "--tensor-parallel runs the example model"),
])
def test_generate_refuses_bad_tensor_parallel_options(capsys, argv, match):
    assert cli_main(["generate", "--config", "tiny", *argv]) == 2
    captured = capsys.readouterr()
    assert match in captured.err and captured.out == ""


def test_generate_one_rank_without_a_launcher(capsys):
    """--tensor-parallel 1 makes a one-process group (no launcher) and tears it down."""
    rc = cli_main(["generate", "--config", "tiny", "--tensor-parallel", "1", "--dtype", "float64",
                   "--backend", "numpy", "--batch", "2", "--prompt-len", "6", "--new-tokens", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tensor parallel: 1 ranks (gloo); rank 0/1: query heads 0..7, KV heads 0..1" in out
    assert "greedy tokens identical: yes" in out
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun is not installed beside this Python")
def test_torchrun_generate_command(tmp_path):
    """The documented launch: torchrun --standalone --nproc-per-node 2 -m gqakv generate ..."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "gqakv", "generate",
                           "--tensor-parallel", "2", "--config", "tiny", "--dtype", "float64", "--backend",
                           "numpy", "--batch", "3", "--prompt-len", "9", "--new-tokens", "4", "--chunk", "4",
                           "--page-size", "4", "--tp-timeout", "60"],
                          cwd=tmp_path, env=loopback_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.count("gqakv generate: tiny model") == 1  # rank 0 alone prints
    assert "tensor parallel: 2 ranks (gloo); rank 0/2: query heads 0..3, KV heads 0..0" in out
    assert "greedy tokens identical: yes" in out


def test_scaling_guide_code_runs_as_written(capsys):
    """docs/guides/scaling.md: every ```python block runs (a one-process group where it
    communicates) and prints what the ```text block after it shows; every ``$ gqakv``
    command of a ```console block prints what the block shows (the torchrun commands are
    test_torchrun_generate_command's)."""
    import re
    import shlex

    text = (ROOT / "docs" / "guides" / "scaling.md").read_text()
    consoles = re.findall(r"```console\n(.*?)```", text, flags=re.S)
    commands = [block.split("\n$ ") for block in consoles if block.startswith("$ gqakv ")]
    assert commands, "the guide's gqakv size example"
    for block in commands:
        for entry in block:
            command, _, shown = entry.removeprefix("$ ").partition("\n")
            assert cli_main(shlex.split(command)[1:]) == 0, command
            assert capsys.readouterr().out == shown, (command, shown)
    blocks = re.findall(r"```(python|text)\n(.*?)```", text, flags=re.S)
    assert sum(kind == "python" for kind, _ in blocks) >= 4
    for i, (kind, code) in enumerate(blocks):
        if kind != "python":
            continue
        exec(compile(code, f"scaling.md python block {i}", "exec"), {"__name__": "__doc__"})
        printed = capsys.readouterr().out
        shown = next((body for k, body in blocks[i + 1:i + 2] if k == "text"), None)
        if shown is not None:
            assert printed == shown, (printed, shown)
        else:
            assert printed  # the script example prints its tokens


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
