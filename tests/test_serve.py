"""`mkdsl serve` driven by the official `openai` client: the Llama mini from a synthetic Hugging
Face checkpoint (random weights, tests/test_run.py's byte-level tokenizer and chat template),
decoded by the spec's reference step (`--decode reference`: no interpret-mode kernel, so it is
fast), 2 rows, on 127.0.0.1. The server runs under `timeout`, so it ends even if the test dies."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
from checkpoint_writers import hf_tensors
from safetensors.numpy import save_file
from test_run import write_tokenizer

import mkdsl

openai = pytest.importorskip("openai", reason="the `test` extra installs the openai client")  # CI has it

ROOT = Path(__file__).resolve().parent.parent
SERVER_LIFETIME_S = 900  # the server is killed by `timeout` after this, whatever happens
MODEL = "llama-mini"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    spec = mkdsl.load(ROOT / "specs/llama3_8b.mk", "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=11)
    root = tmp_path_factory.mktemp("serve_llama_mini")
    save_file(hf_tensors(weights, 2), str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    write_tokenizer(root, spec.model.const["V"])
    port = _port()
    cmd = ["timeout", str(SERVER_LIFETIME_S), sys.executable, "-m", "mkdsl", "serve", str(ROOT / "specs/llama3_8b.mk")]
    cmd += ["--profile", "mini", "--weights", str(root), "--decode", "reference", "--batch", "2", "--context", "256"]
    cmd += ["--port", str(port), "--model-name", MODEL]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MKDSL_CACHE": str(root / "cache")}
    log = open(root / "server.log", "w")  # noqa: SIM115  (closed at teardown)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the server did not come up in 300 s:\n" + (root / "server.log").read_text()[-3000:])
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    yield base, client
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def complete(client, prompt: str, n: int = 12, **kw) -> str:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **kw)
    return out.choices[0].text


def test_health_and_models(server):
    base, client = server
    health = httpx.get(f"{base}/health", timeout=10).json()
    assert health["status"] == "ok" and health["rows"] == 2 and health["rows_free"] == 2
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_completion_is_the_greedy_decode(server):
    """The server's text equals greedy decoding of the prompt by the same spec and weights here
    (mkdsl.run.decode.generate on the reference step): same tokens, the same text."""
    _, client = server
    out = client.completions.create(model=MODEL, prompt="the hello", max_tokens=10, temperature=0, seed=1)
    choice = out.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens > 0 and 0 < out.usage.completion_tokens <= 10
    assert choice.text == _local_greedy("the hello", 10)


def _local_greedy(prompt: str, n: int) -> str:
    from tokenizers import Tokenizer

    from mkdsl.run.decode import Decoder, cached_kernel, generate
    from mkdsl.run.sampling import Sampling

    spec = mkdsl.load(ROOT / "specs/llama3_8b.mk", "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=11)
    module, _ = cached_kernel(spec.source, spec.path, "mini")
    decoder = Decoder(spec, module, weights, 2, 256, Sampling(), interpret=None, decode="reference", prefill="xla")
    tk = _tokenizer(Tokenizer)
    result = generate(
        decoder, tk.encode(prompt, add_special_tokens=False).ids, n, frozenset([tk.token_to_id("<|end|>")])
    )
    ids = []
    for t in result.tokens[0]:
        if int(t) == tk.token_to_id("<|end|>"):
            break
        ids.append(int(t))
    return tk.decode(ids, skip_special_tokens=True)


def _tokenizer(cls):
    import tempfile

    spec = mkdsl.load(ROOT / "specs/llama3_8b.mk", "mini")
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(Path(d), spec.model.const["V"])
        return cls.from_file(str(Path(d) / "tokenizer.json"))


def test_a_streamed_chat_completion_equals_the_whole_one(server):
    _, client = server
    messages = [{"role": "user", "content": "the the hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content


def test_two_concurrent_requests_get_what_each_gets_alone(server):
    _, client = server
    prompts = ["the hello the", "llll hello"]
    alone = [complete(client, p, 16) for p in prompts]
    assert alone[0] != alone[1]  # different prompts, different texts: a mix-up would show
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda p: complete(client, p, 16), prompts))
    assert together == alone


def test_sampling_is_reproducible_by_seed_and_stop_cuts_the_text(server):
    _, client = server
    kw = {
        "model": MODEL,
        "prompt": "the",
        "max_tokens": 12,
        "temperature": 0.9,
        "top_p": 0.9,
        "extra_body": {"top_k": 50},
    }
    a = client.completions.create(seed=5, **kw).choices[0].text
    b = client.completions.create(seed=5, **kw).choices[0].text
    assert a == b
    greedy = complete(client, "the hello", 10)
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 2]
    if stop.strip():
        cut = complete(client, "the hello", 10, stop=[stop])
        assert cut == greedy[: greedy.find(stop)]


def test_bad_requests_get_400_with_an_error_body(server):
    base, client = server
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="the", max_tokens=4, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.body["message"]
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type"}
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "the", "max_tokens": 10**6})
    assert r.status_code == 400 and "exceed the context" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="the", max_tokens=4)
    assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"  # the server is fine


def test_a_client_leaving_mid_stream_frees_its_row(server):
    base, _ = server
    before = httpx.get(f"{base}/health", timeout=10).json()["left_early"]
    # a chat stream's first chunk (the role) comes before any token: leaving after it is leaving
    # before the end, however fast the tokens come; the engine sees it at the row's next token
    messages = [{"role": "user", "content": "the"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))  # then the client leaves
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(f"{base}/health", timeout=10).json()
        if health["rows_free"] == 2 and health["left_early"] > before:
            break
        time.sleep(0.2)
    assert health["rows_free"] == 2 and health["left_early"] == before + 1, health
    assert np.isfinite(len(complete(server[1], "the", 4)))  # and it serves the next request
