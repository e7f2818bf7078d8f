"""`mkdsl run` and the loader feeding the kernel: a synthetic Hugging Face checkpoint of the
Llama mini (real names and layouts, random values, a byte-level tokenizer.json) loads onto the
device and runs a kernel step equal to the reference; the command streams text and closes with
its timings; a checkpoint that does not fit is an error naming the tensor, exit 1, before any
compile."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from checkpoint_writers import hf_tensors
from safetensors.numpy import save_file

import mkdsl
from mkdsl.cli import main
from mkdsl.run.decode import cached_kernel

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "specs" / "llama3_8b.mk"
CHAT = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|bot|>{% endif %}"


def write_tokenizer(root: Path, vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` tokens: the 256 byte symbols, a few merges, specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    specials = ["<|end|>", "<|user|>", "<|bot|>"]
    while len(vocab) < vocab_size - len(specials):
        vocab[f"<unused{len(vocab)}>"] = len(vocab)
    for s in specials:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tk.save(str(root / "tokenizer.json"))
    config = {"eos_token": "<|end|>", "chat_template": CHAT}
    (root / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    spec = mkdsl.load(LLAMA, "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=5)
    root = tmp_path_factory.mktemp("llama_mini_hf")
    save_file(hf_tensors(weights, 2), str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    write_tokenizer(root, spec.model.const["V"])
    return spec, weights, root


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MKDSL_CACHE", str(tmp_path_factory.getbasetemp() / "mkdsl-cache"))


def test_loaded_weights_run_a_kernel_step_equal_to_the_reference(llama):
    from jax.experimental.pallas import tpu as pltpu

    spec, weights, root = llama
    module, where = cached_kernel(spec.source, spec.path, "mini")
    assert (where / "kernel.py").exists() and "generated" not in where.parts
    loaded, _ = mkdsl.load_weights(spec, root, module=module, progress=False)
    state = {k: np.zeros(s.shape, s.dtype) for k, s in module.state_layout(2, 256).items()}
    tokens, positions = np.array([3, 300], np.int32), np.array([0, 0], np.int32)
    ref_logits, ref_next, _ = mkdsl.reference_step(spec)(weights, state, tokens, positions)
    step = module.build_decode_step(2, 256, interpret=pltpu.InterpretParams())
    logits, next_tokens, _ = step(loaded, state, tokens, positions)
    scale = float(np.abs(ref_logits).max())
    # 2^-6 of the row's largest logit: mkdsl/verify/kernel.py's logit bound (bf16 inputs to every matmul
    # of both layers), here the whole step from the embedding since the prompt is one token
    assert float(np.abs(np.asarray(logits) - ref_logits).max()) <= 2**-6 * scale
    assert np.array_equal(np.asarray(next_tokens), np.asarray(ref_next))


def test_run_streams_text_and_closes_with_timings(llama, capsys):
    spec, _, root = llama
    argv = ["run", str(LLAMA), "-p", "mini", "--weights", str(root), "--prompt", "the hello", "--max-tokens", "5"]
    assert main([*argv, "--interpret", "--steps-per-call", "2", "--temperature", "0.7", "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("the hello") and out.endswith("\n"), out
    assert "loaded 21 tensors" in err
    assert re.search(
        r"prefill \(XLA\) [\d.]+ s for \d+ tokens; first decode call .* [\d.]+ ms/step, [\d.]+ tokens/s", err
    ), err


def test_run_chat_uses_the_checkpoint_template(llama):
    from mkdsl.checkpoint.formats import open_checkpoint
    from mkdsl.checkpoint.tokenizer import load_codec

    codec = load_codec(open_checkpoint(llama[2]))
    text = codec.chat("hi")
    assert text == "<|user|>hi<|bot|>"
    ids = codec.encode(text)
    assert ids[0] == codec.tokenizer.token_to_id("<|user|>") and ids[-1] == codec.tokenizer.token_to_id("<|bot|>")
    assert codec.eos_ids == {codec.tokenizer.token_to_id("<|end|>")}


@pytest.mark.parametrize(
    "change, message",
    [
        ("missing", r"missing tensor `model\.layers\.1\.self_attn\.o_proj\.weight` for `wo` \(layer 1\)"),
        ("shape", r"tensor `model\.layers\.1\.self_attn\.o_proj\.weight` is BF16 \[256, 128\].*expected \[256, 256\]"),
        ("dtype", r"tensor `model\.layers\.1\.self_attn\.o_proj\.weight` is F16, which bf16 cannot hold exactly"),
    ],
)
def test_run_refuses_a_checkpoint_that_does_not_fit(llama, tmp_path, capsys, change, message):
    spec, weights, root = llama
    tensors = hf_tensors(weights, 2)
    name = "model.layers.1.self_attn.o_proj.weight"
    if change == "missing":
        del tensors[name]
    elif change == "shape":
        tensors[name] = tensors[name][:, :128].copy()
    else:
        tensors[name] = tensors[name].astype(np.float16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    argv = ["run", str(LLAMA), "-p", "mini", "--weights", str(tmp_path / "model.safetensors"), "--prompt", "x"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err


def test_run_usage_errors_exit_2(llama, capsys):
    root = str(llama[2])
    assert main(["run", str(LLAMA), "-p", "mini", "--weights", "/nonexistent.gguf", "--prompt", "x"]) == 2
    assert main(["run", str(LLAMA), "-p", "mini", "--weights", root, "--prompt", "x", "--batch", "9"]) == 2
    assert main(["run", str(LLAMA), "-p", "mini", "--weights", root, "--prompt", "x", "--top-p", "0"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_interactive_prompts_are_the_nonblank_lines_of_stdin(monkeypatch):
    import io

    from mkdsl.cli import _stdin_prompts

    monkeypatch.setattr("sys.stdin", io.StringIO("first prompt\n\n  \nsecond\n"))
    assert list(_stdin_prompts()) == ["first prompt", "second"]


def test_unpad_weights_undoes_the_modules_padding():
    from mkdsl.run.decode import unpad_weights

    w = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # 2 devices' blocks of 2 columns
    padded = np.concatenate([np.pad(p, [(0, 0), (0, 0), (0, 3)]) for p in np.split(w, 2, axis=-1)], axis=-1)
    both = np.pad(padded, [(0, 0), (0, 2), (0, 0)])  # also its rows, 3 of them padded to 5 (one block)
    pads = {"w": ((-1, 2, 5, 2),), "t": ((-2, 2, 5, 2),), "b": ((-2, 3, 5, 1), (-1, 2, 5, 2))}
    back = unpad_weights({"w": padded, "t": np.swapaxes(padded, -1, -2), "b": both}, pads)
    assert np.array_equal(back["w"], w) and np.array_equal(back["t"], np.swapaxes(w, -1, -2))
    assert np.array_equal(back["b"], w)
