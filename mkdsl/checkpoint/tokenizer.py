"""The checkpoint's own tokenizer and chat template.

Hugging Face: `tokenizer.json` (and `tokenizer_config.json` for the chat template and the end
token) next to the safetensors. GGUF: a byte-level BPE built with the `tokenizers` library from
the file's vocabulary and merges, split before BPE as its `tokenizer.ggml.pre` names; control
tokens (`<|im_start|>`) are special, so chat markup becomes single tokens.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass

from mkdsl.checkpoint.formats import CheckpointError

# The pre-tokenizer regexes llama.cpp uses for each `tokenizer.ggml.pre` (byte-level BPE models).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_SPLITS = {
    "gpt2": (_GPT2,),
    "default": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),  # digits one by one, then GPT-2's split
    "llama-bpe": (_LLAMA3,),
}
_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types that are special tokens


@dataclass
class TextCodec:
    """Encode, decode, the end-of-text ids and the chat template (None if the checkpoint has none)."""

    tokenizer: object  # tokenizers.Tokenizer
    eos_ids: frozenset[int]
    chat_template: str | None
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat(self, prompt: str) -> str:
        """The prompt as one user turn through the checkpoint's chat template, ready for the reply."""
        return self.render([{"role": "user", "content": prompt}])

    def render(self, messages: list[dict]) -> str:
        """A conversation (role, content) through the checkpoint's chat template, ready for the reply."""
        if not self.chat_template:
            raise CheckpointError("the checkpoint has no chat template (--chat needs one)")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise CheckpointError(f"the chat template refused the conversation: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
        )


def load_codec(reader) -> TextCodec:
    """The tokenizer of an open checkpoint (`formats.open_checkpoint`)."""
    return _gguf_codec(reader) if reader.format == "gguf" else _hf_codec(reader.root)


def _hf_codec(root) -> TextCodec:
    from tokenizers import Tokenizer

    path = root / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"no tokenizer.json next to the checkpoint in {root}")
    tk = Tokenizer.from_file(str(path))
    config = {}
    if (root / "tokenizer_config.json").exists():
        config = json.loads((root / "tokenizer_config.json").read_text())
    eos = _token_text(config.get("eos_token"))
    bos = _token_text(config.get("bos_token"))
    eos_id = tk.token_to_id(eos) if eos else None
    return TextCodec(tk, frozenset([eos_id] if eos_id is not None else []), config.get("chat_template"), bos, eos)


def _token_text(t) -> str:
    return t.get("content", "") if isinstance(t, dict) else (t or "")


def _gguf_codec(reader) -> TextCodec:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    model = reader.metadata("tokenizer.ggml.model")
    pre = reader.metadata("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model `{model}`: only byte-level BPE (`gpt2`) is supported")
    if pre not in PRE_SPLITS:
        raise CheckpointError(f"GGUF pre-tokenizer `{pre}` is not supported (known: {', '.join(PRE_SPLITS)})")
    tokens = reader.metadata("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError("GGUF tokenizer: `tokenizer.ggml.tokens` is missing or empty")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _gguf_merges(reader.metadata("tokenizer.ggml.merges", []), vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[pre]]
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    types = reader.metadata("tokenizer.ggml.token_type", [])
    tk.add_special_tokens([tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)])
    eos, bos = (_token_id(reader, f"tokenizer.ggml.{k}_token_id", len(tokens)) for k in ("eos", "bos"))
    return TextCodec(
        tk,
        frozenset([int(eos)] if eos is not None else []),
        reader.metadata("tokenizer.chat_template"),
        tokens[int(bos)] if bos is not None else "",
        tokens[int(eos)] if eos is not None else "",
    )


def _gguf_merges(merges: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges `a b`, checked: two tokens of the vocabulary whose join is one too (what
    llama.cpp's loader requires), so a damaged tokenizer is named here, not a tokenizers panic."""
    out = []
    for i, m in enumerate(merges):
        pair = tuple(m.split(" ", 1))
        if len(pair) != 2:
            raise CheckpointError(f"GGUF tokenizer: merge {i} {m!r} is not two tokens separated by a space")
        unknown = [t for t in (*pair, pair[0] + pair[1]) if t not in vocab]
        if unknown:
            raise CheckpointError(f"GGUF tokenizer: merge {i} {m!r} names {unknown[0]!r}, not in the vocabulary")
        out.append(pair)
    return out


def _token_id(reader, key: str, n: int) -> int | None:
    """A special token's id from the metadata, checked to be a token of the vocabulary."""
    value = reader.metadata(key)
    if value is None:
        return None
    if not isinstance(value, numbers.Integral) or not 0 <= value < n:
        raise CheckpointError(f"GGUF tokenizer: `{key}` is {value!r}, not a token id in 0 .. {n - 1}")
    return int(value)
