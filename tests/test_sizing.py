"""Cache sizing: presets against the arithmetic 2 x layers x kv_heads x head_dim x bytes,
budgets, Hugging Face config.json parsing and the ``gqakv size`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gqakv
from gqakv.storage import sizing
from gqakv.tools.cli import main

# (layers, query heads, KV heads, head dim) as each model's published config.json gives them.
PUBLISHED = {
    "llama-3.1-8b": (32, 32, 8, 128),
    "llama-3.1-70b": (80, 64, 8, 128),
    "llama-2-70b": (80, 64, 8, 128),
    "mistral-7b": (32, 32, 8, 128),
    "qwen2.5-7b": (28, 28, 4, 128),
    "gpt2": (12, 12, 12, 64),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_match_published_shapes_and_arithmetic(name):
    cfg = sizing.get_preset(name)
    layers, hq, hkv, d = PUBLISHED[name]
    assert (cfg.layers, cfg.q_heads, cfg.kv_heads, cfg.head_dim) == (layers, hq, hkv, d)
    for dtype, item in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        assert cfg.bytes_per_token(dtype) == 2 * layers * hkv * d * item
        assert sizing.cache_bytes(name, max_len=1000, batch=3, dtype=dtype) == 3000 * 2 * layers * hkv * d * item
        # and the allocation a ModelKVCache of that shape would make
        assert gqakv.ModelKVCache.nbytes_for(layers, 3, hkv, 1000, d, dtype) == \
            sizing.cache_bytes(cfg, max_len=1000, batch=3, dtype=dtype)


def test_llama_31_8b_numbers_from_the_issue():
    assert sizing.get_preset("llama-3.1-8b").bytes_per_token("bfloat16") == 131_072
    assert sizing.cache_bytes("llama-3.1-8b", max_len=4096, dtype="bfloat16") == 512 * 2**20


def test_every_preset_is_consistent():
    for cfg in sizing.PRESETS.values():
        assert cfg.q_heads % cfg.kv_heads == 0, cfg  # GQA groups divide evenly
        assert cfg.layers > 0 and cfg.head_dim > 0 and cfg.max_position > 0


@pytest.mark.parametrize("name", ["Llama_3.1_8B", "LLAMA-3.1-8B", "meta-llama-3.1-8b", " llama 3.1 8b "])
def test_preset_names_are_forgiving(name):
    assert sizing.get_preset(name).name == "llama-3.1-8b"


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="unknown model 'llama-9'.*llama-3.1-8b"):
        sizing.get_preset("llama-9")


def test_budget_largest_batch_and_length():
    per_row = sizing.cache_bytes("llama-3.1-8b", max_len=4096)  # 512 MiB
    assert sizing.max_batch("llama-3.1-8b", max_len=4096, budget="80GiB") == 160
    assert sizing.max_batch("llama-3.1-8b", max_len=4096, budget=per_row * 7 - 1) == 6
    assert sizing.max_len_for("llama-3.1-8b", batch=1, budget="80GiB") == 80 * 2**30 // 131_072
    n = sizing.max_len_for("qwen2.5-7b", batch=3, budget=10**9)
    per_token = sizing.get_preset("qwen2.5-7b").bytes_per_token()
    assert 3 * n * per_token <= 10**9 < 3 * (n + 1) * per_token


@pytest.mark.parametrize("text,value", [("80GiB", 80 * 2**30), ("24GB", 24 * 10**9),
                                        ("512 MiB", 512 * 2**20), ("1e9", 10**9), ("1.5kib", 1536),
                                        (4096, 4096)])
def test_parse_bytes(text, value):
    assert sizing.parse_bytes(text) == value


def test_parse_bytes_rejects_nonsense():
    with pytest.raises(ValueError, match="cannot read a byte count from '12 parsecs'"):
        sizing.parse_bytes("12 parsecs")


def test_config_from_hf_llama_and_gpt2(tmp_path):
    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096, "max_position_embeddings": 131072, "model_type": "llama"}
    path = tmp_path / "Llama-3.1-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(llama))
    cfg = sizing.resolve_model(str(path))
    assert (cfg.layers, cfg.kv_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.bytes_per_token("bfloat16") == 131_072
    gpt2 = sizing.config_from_hf({"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024})
    assert (gpt2.layers, gpt2.kv_heads, gpt2.head_dim, gpt2.max_position) == (12, 12, 64, 1024)
    # explicit head_dim wins over hidden_size / heads (as in some Mistral/Gemma configs)
    cfg = sizing.config_from_hf({**llama, "head_dim": 64})
    assert cfg.head_dim == 64


def test_model_cache_for_model(backend, arrays):
    """for_model shapes the cache from the preset and allocates it on the backend it is
    handed: its buffers are that backend's arrays (the cache's own behaviour on each backend
    is tests/test_model_cache.py's)."""
    cache = gqakv.ModelKVCache.for_model("gpt2", batch=2, max_len=8, dtype="float32", backend=backend)
    assert (cache.layers, cache.kv_heads, cache.head_dim) == (12, 12, 64)
    assert cache.nbytes == sizing.cache_bytes("gpt2", max_len=8, batch=2, dtype="float32")
    assert cache.backend is backend
    assert type(cache.k) is type(arrays.asarray(np.zeros(1), "float32"))
    assert (cache.dtype, cache.k.shape) == ("float32", (12, 2, 12, 8, 64))


def test_size_command(capsys):
    assert main(["size", "llama-3.1-8b", "--max-len", "4096", "--dtype", "bfloat16",
                 "--budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "131,072 bytes" in out and "536,870,912 bytes (512.0 MiB)" in out
    assert "largest batch at max_len 4,096: 160" in out
    assert "largest max_len at batch 1: 655,360 tokens" in out


def test_size_command_list_and_errors(capsys):
    assert main(["size", "--list"]) == 0
    out = capsys.readouterr().out
    for name in PUBLISHED:
        assert name in out
    assert main(["size", "no-such-model"]) == 2
    assert "gqakv: error: unknown model" in capsys.readouterr().err  # the CLI's one-line error
    assert main(["size", "gpt2", "--max-len", "2048"]) == 0
    assert "exceeds the model's context 1,024" in capsys.readouterr().out
