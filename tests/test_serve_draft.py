"""`mkdsl serve --draft`: its arguments checked before any weights are read, and the server with
the n-gram drafter answering what the plain server answers (tiny, random weights, the kernel in
TPU interpret mode, both apps in this process on FastAPI's test client), with the drafts'
figures in the response's usage."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

import mkdsl
from mkdsl import cli

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "specs" / "tiny.mk")
SEQ_LEN = 256


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--draft", "bogus"], "expected one of ngram, mtp"),
        (["--draft", "mtp"], "tiny (" + TINY + ") declares no `mtp` head"),
        (["--draft", "specs/kimi_k3_dspark.mk"], "reads layers [24, 48, 72, 88, 92] of tiny, which has 2"),
        (["--draft", "ngram", "--draft-weights", "x"], "the n-gram drafter has no weights"),
        (["--draft", "ngram", "--draft-rows", "17"], "--draft-rows must be in 2 .. 16"),
        (["--draft", "ngram", "--batch", "2"], "one sequence"),
        (["--draft-rows", "4"], "need --draft"),
    ],
)
def test_serve_draft_arguments_are_usage_errors_before_loading(capsys, extra, message):
    # the weights do not exist: a check after loading would say so instead
    assert cli.main(["serve", TINY, "--weights", "/nonexistent.gguf", "--decode", "reference", *extra]) == 2
    assert message in capsys.readouterr().err


class ByteCodec:
    """Text as its latin-1 bytes, one token each (tiny's vocabulary is 256); no end token, so
    every completion runs to max_tokens."""

    eos_ids = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("latin-1"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("latin-1")


def _served(engine, prompts: list[str], n: int) -> list[dict]:
    """Each prompt's greedy completion from an app on `engine` (its thread started and stopped here)."""
    from fastapi.testclient import TestClient

    from mkdsl.run.serve import build_app

    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    try:
        with TestClient(build_app(engine, ByteCodec(), "tiny", SEQ_LEN)) as client:
            body = {"model": "tiny", "max_tokens": n, "temperature": 0}
            return [client.post("/v1/completions", json={**body, "prompt": p}).json() for p in prompts]
    finally:
        engine.stop()
        thread.join(timeout=60)


@pytest.mark.timeout(600)
def test_ngram_speculative_server_answers_as_the_plain_server():
    """Two prompts, 24 tokens each, greedy: the speculative server's text (each verify step ONE
    4-row kernel step, mkdsl/run/verify_rows.py) is the plain server's, character for character;
    its usage counts the verify steps and the drafts kept and refused."""
    from jax.experimental.pallas.tpu import InterpretParams

    from mkdsl.run.decode import Decoder
    from mkdsl.run.drafters import NgramDrafter
    from mkdsl.run.engine import Engine
    from mkdsl.run.sampling import Sampling
    from mkdsl.run.serve_draft import SpeculativeEngine

    spec = mkdsl.load(TINY)
    module = mkdsl.load_kernel(spec)
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=SEQ_LEN, seed=7)
    packed = mkdsl.kernel_weights(weights)
    axes = {t.name: 1 if t.stacked else 0 for t in spec.model.states}

    # as `mkdsl serve` makes it on a CPU; one decoder (its prefill compiled once), one engine after the other
    decoder = Decoder(spec, module, packed, 1, SEQ_LEN, Sampling(), interpret=InterpretParams(), prefill="xla")
    prompts, n = ["the cat and the cat and the"], 16
    plain = _served(Engine(decoder, axes), prompts, n)
    fast = _served(SpeculativeEngine(decoder, axes, lambda: NgramDrafter(4), "ngram"), prompts, n)
    for p, f in zip(plain, fast, strict=True):
        assert "error" not in p and "error" not in f, (p, f)
        assert len(p["choices"][0]["text"]) == n and f["choices"][0]["text"] == p["choices"][0]["text"]
        assert f["usage"]["completion_tokens"] == n and "speculative" not in p["usage"]
        s, d = f["usage"]["speculative"], f["usage"]["completion_tokens_details"]
        assert s["drafter"] == "ngram" and s["rows"] == 4 and 1 <= s["verify_steps"] < n
        kept = d["accepted_prediction_tokens"]
        assert kept + d["rejected_prediction_tokens"] == 3 * s["verify_steps"]  # R - 1 drafts a step
        assert s["mean_accepted_per_step"] == pytest.approx((kept + s["verify_steps"]) / s["verify_steps"])
        # every token after the prefill's came from a verify step: at least n - 1 accepted in all
        assert kept + s["verify_steps"] >= n - 1
    assert np.mean([f["usage"]["speculative"]["mean_accepted_per_step"] for f in fast]) > 1


@pytest.mark.timeout(900)
def test_serve_draft_command_serves_the_plain_greedy_text(tmp_path):
    """`mkdsl serve ... --draft ngram --draft-rows 4` as a user starts it (the Llama mini of
    tests/test_serve.py, its reference verify step: `--decode reference`): the greedy completion
    is plain greedy decoding's, streamed or whole; /health names the drafter; standard error gets
    each request's verify steps and mean accepted tokens per step."""
    import json
    import os
    import subprocess
    import sys
    import time

    import httpx2 as httpx
    from checkpoint_writers import hf_tensors
    from safetensors.numpy import save_file
    from test_run import write_tokenizer
    from test_serve import MODEL, _local_greedy, _port

    spec = mkdsl.load(ROOT / "specs/llama3_8b.mk", "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=11)  # test_serve's weights
    save_file(hf_tensors(weights, 2), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    write_tokenizer(tmp_path, spec.model.const["V"])
    port = _port()
    cmd = ["timeout", "600", sys.executable, "-m", "mkdsl", "serve", str(ROOT / "specs/llama3_8b.mk"), "-p", "mini"]
    cmd += ["--weights", str(tmp_path), "--decode", "reference", "--context", "256", "--port", str(port)]
    cmd += ["--model-name", MODEL, "--draft", "ngram", "--draft-rows", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MKDSL_CACHE": str(tmp_path / "cache")}
    log = tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                try:
                    health = httpx.get(f"{base}/health", timeout=2).json()
                    break
                except httpx.HTTPError:
                    time.sleep(0.5)
            assert health["rows"] == 1 and health["draft"] == "ngram" and health["draft_rows"] == 4
            body = {"model": MODEL, "prompt": "the hello the hello the hello", "max_tokens": 12, "temperature": 0}
            whole = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
            with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
            streamed = "".join(json.loads(x)["choices"][0]["text"] for x in lines)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    text = whole["choices"][0]["text"]
    assert text == _local_greedy(body["prompt"], 12) and streamed == text
    assert whole["usage"]["speculative"]["verify_steps"] >= 1
    assert log.read_text().count("mkdsl serve: speculative (ngram, 4 rows per verify step): ") == 2


@pytest.mark.timeout(600)
def test_a_draft_spec_server_answers_request_after_request_as_the_plain_server():
    """A model drafter reading the target's hidden states (tests/data/tiny_draft.mk, random
    weights, layers 0 and 1 of tiny) behind the server, tiny's reference verify step (`--decode
    reference`): two requests one after the other, each from a zeroed state and a drafter that
    heard only its own prompt, get the plain server's texts."""
    from mkdsl.run.decode import Decoder
    from mkdsl.run.engine import Engine
    from mkdsl.run.sampling import Sampling
    from mkdsl.run.serve_draft import SpeculativeEngine

    spec = mkdsl.load(TINY)
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=SEQ_LEN, seed=7)
    axes = {t.name: 1 if t.stacked else 0 for t in spec.model.states}
    module = mkdsl.load_kernel(spec)  # its layouts; the steps are the reference's
    packed = mkdsl.kernel_weights(weights)
    decoder = Decoder(spec, module, packed, 1, SEQ_LEN, Sampling(), interpret=None, prefill="xla", decode="reference")
    prompts, n = ["the cat and the cat and the", "abcabcabcabcabcabcab"], 12  # one prefill bucket (32)
    plain = _served(Engine(decoder, axes), prompts, n)

    def drafter():
        return mkdsl.make_drafter(str(ROOT / "tests" / "data" / "tiny_draft.mk"), spec, rows=4, seed=1)

    fast = _served(SpeculativeEngine(decoder, axes, drafter, "tiny_draft.mk"), prompts, n)
    assert plain[0]["choices"][0]["text"] != plain[1]["choices"][0]["text"]  # a mix-up of requests would show
    for p, f in zip(plain, fast, strict=True):
        assert f["choices"][0]["text"] == p["choices"][0]["text"] and len(p["choices"][0]["text"]) == n
        assert f["usage"]["speculative"]["drafter"] == "tiny_draft.mk"
