"""The tokenizer stored in a GGUF file, as a Hugging Face ``tokenizers`` tokenizer (no torch).

A GGUF file with ``tokenizer.ggml.model = "gpt2"`` carries a byte-level BPE tokenizer:
the token strings (``tokenizer.ggml.tokens``, id = position), the merges in priority
order (``tokenizer.ggml.merges``, "left right"), each token's type
(``tokenizer.ggml.token_type``: 3 = control, 4 = user-defined), the special ids and the
chat template. ``GGUFTokenizer`` builds from them the same pipeline transformers builds
when it loads the file (its loader imports torch): byte-level pre-tokenization with the
GPT-2 split regex (or the split the file's ``tokenizer.ggml.pre`` names, where it differs),
BPE over the merges, control tokens matched whole as special tokens, user-defined ones as
plain added tokens, and a BOS prepended only where ``tokenizer.ggml.add_bos_token`` says so.
"""

from __future__ import annotations

# Split regexes for pre-tokenizer names whose split is not GPT-2's (llama.cpp's names).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}
# Names whose split is GPT-2's regex (what ByteLevel(use_regex=True) applies).
_GPT2_SPLIT_NAMES = {None, "default", "gpt2", "gpt-2", "smollm"}

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling of byte-level tokens)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # unprintable bytes move past 255, in byte order
            table[b] = chr(256 + extra)
            extra += 1
    return table


class GGUFTokenizer:
    """Encode/decode with a GGUF file's byte-level BPE tokenizer.

    Args:
        fields: the file's metadata, key -> value (``GGUFCheckpoint.reader`` fields are read
            on demand by ``from_reader``).

    Attributes: ``tokenizer`` (the ``tokenizers.Tokenizer``), ``bos_id``, ``eos_id``,
    ``pad_id`` (None when the file names none), ``chat_template`` (a Jinja string or None).
    """

    def __init__(self, fields: dict):
        try:
            from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
        except ImportError as exc:
            raise ModuleNotFoundError("the GGUF tokenizer needs the tokenizers package: "
                                      "pip install tokenizers") from exc
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') tokenizers "
                             f"are supported")
        pre = fields.get("tokenizer.ggml.pre")
        if pre not in _GPT2_SPLIT_NAMES and pre not in _SPLITS:
            raise ValueError(f"tokenizer.ggml.pre={pre!r}: unknown pre-tokenizer (supported: "
                             f"{', '.join(sorted(n for n in _GPT2_SPLIT_NAMES | set(_SPLITS) if n))})")
        tokens = list(fields["tokenizer.ggml.tokens"])
        merges = list(fields.get("tokenizer.ggml.merges") or [])
        if not merges:
            raise ValueError("tokenizer.ggml.merges is missing: a byte-level BPE file lists its merges")
        types = list(fields.get("tokenizer.ggml.token_type") or [])
        alphabet = _byte_alphabet()
        spelled = set(alphabet.values())
        # A token written in plain text (not in the byte alphabet) is re-spelled byte by byte.
        vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                         continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        tok = Tokenizer(bpe)
        if pre in _SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        # Control tokens (like <|im_start|>) are matched whole and are special; a control token
        # spelled outside the byte alphabet is a mislabel and stays an ordinary vocabulary entry.
        control = [t for t, k in zip(tokens, types) if k == CONTROL and set(t) <= spelled]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        user = [t for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        self.tokenizer = tok
        self.vocab_size = len(tokens)

        def special(key):
            value = fields.get(f"tokenizer.ggml.{key}")
            return None if value is None else int(value)

        self.bos_id, self.eos_id, self.pad_id = special("bos_token_id"), special("eos_token_id"), \
            special("padding_token_id")
        self.add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False)) and self.bos_id is not None
        self.chat_template = fields.get("tokenizer.chat_template")
        self.tokens = tokens

    @classmethod
    def from_reader(cls, reader) -> "GGUFTokenizer":
        """From a ``gguf.GGUFReader`` (only the ``tokenizer.*`` fields are read)."""
        return cls({k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")})

    @classmethod
    def from_file(cls, path: str) -> "GGUFTokenizer":
        from .gguf import _require_gguf

        return cls.from_reader(_require_gguf().GGUFReader(path))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens in the text are matched whole)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos else ids

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token (for streaming; a byte-level token may be part of a character)."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The file's chat template rendered for ``messages`` ([{"role", "content"}]), as text."""
        if not self.chat_template:
            raise ValueError("this GGUF file has no tokenizer.chat_template")
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise ModuleNotFoundError("chat templates need jinja2: pip install jinja2") from exc
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        special = lambda i: None if i is None else self.tokens[i]  # noqa: E731
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=special(self.bos_id) or "", eos_token=special(self.eos_id) or "")
