"""`mkdsl serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the engine.

Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the
checkpoint's chat template), each completion whole or streamed as server-sent events (`stream`).
Options: `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop` (strings; the text ends
before the first). A bad request gets OpenAI's error body (`{"error": {"message", "type",
"param", "code"}}`) with status 400 (404 for an unknown model), never a traceback; a streamed
request whose client goes away frees its row.
"""

import asyncio
import json
import queue
import time
import uuid
from collections.abc import Callable
from typing import Any

from mkdsl.run.engine import Engine, Request
from mkdsl.run.sampling import Sampling

POLL_S = 0.1  # how often a waiting response looks at its request's tokens


class TextSink:
    """A request's tokens as text deltas, held back where the text might be the start of a stop
    string (and of a partial UTF-8 character), cut before the first stop string."""

    def __init__(self, codec, stop: list[str]):
        self.codec, self.stop, self.ids, self.sent, self.stopped = codec, stop, [], "", False

    def push(self, token: int | None) -> str:
        """The new text that is certain (all that is left at the end: `token` None)."""
        if token is not None:
            self.ids.append(token)
        text = self.codec.decode(self.ids)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped = text[:cut], True
        elif token is not None:
            if text.endswith("\ufffd"):
                return ""
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        new = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = max(self.sent, text, key=len)
        return new


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class Api:
    """The routes' work: requests to the engine, its tokens to OpenAI's response shapes."""

    def __init__(self, engine: Engine, codec, model_id: str, seq_len: int):
        self.engine, self.codec, self.model_id, self.seq_len = engine, codec, model_id, seq_len
        self.created = int(time.time())

    def health(self) -> dict:
        e = self.engine
        status = "error" if e.error else "ok"
        rows = {"rows": e.batch, "rows_free": e.free_rows(), "waiting": e.waiting.qsize(), "left_early": e.left}
        if e.draft is not None:  # speculative: the drafter and the rows each verify step checks
            rows |= {"draft": e.draft, "draft_rows": e.draft_rows}
        return {"status": status, **rows}

    def models(self) -> dict:
        model = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "mkdsl"}
        return {"object": "list", "data": [model]}

    def start(self, body, prompt_text: str) -> tuple[Request, TextSink]:
        """The request checked and queued for a row."""
        if body.model != self.model_id:
            message = f"the model `{body.model}` does not exist (this server has `{self.model_id}`)"
            raise ApiError(404, message, "model", "not_found_error")
        ids = self.codec.encode(prompt_text)
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "prompt")
        if len(ids) + body.max_tokens + self.engine.ahead > self.seq_len:
            room = self.seq_len - self.engine.ahead  # a speculative verify step writes R - 1 past its anchor
            message = f"{len(ids)} prompt tokens + max_tokens {body.max_tokens} exceed the context ({room})"
            raise ApiError(400, message, "max_tokens")
        sampling = Sampling(body.temperature, body.top_k, body.top_p)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        r = Request(ids, body.max_tokens, sampling, body.seed or 0, self.codec.eos_ids)
        return self.engine.submit(r), TextSink(self.codec, stop)

    async def tokens(self, r: Request):
        """The request's tokens as they come (None at the end)."""
        while True:
            try:
                t = await asyncio.to_thread(r.out.get, True, POLL_S)
            except queue.Empty:
                if self.engine.error is not None:
                    raise ApiError(500, "the engine failed", kind="server_error") from None
                continue
            yield t
            if t is None:
                return

    async def generate(self, r: Request, sink: TextSink):
        """(delta text, finish reason or None) pairs, ("", None) for a token whose text is not
        yet certain; the row is freed however this ends (the stream's generator is closed when
        a write finds the client gone: uvicorn raises there)."""
        try:
            async for t in self.tokens(r):
                text = sink.push(t)
                if sink.stopped:
                    yield text, "stop"
                    return
                if t is None:
                    yield text, r.finish
                    return
                yield text, None
        finally:
            r.cancelled.set()  # the client left, or the text ended: the engine frees the row

    async def collect(self, r: Request, sink: TextSink) -> tuple[str, str]:
        parts, finish = [], "length"
        async for text, why in self.generate(r, sink):
            parts.append(text)
            finish = why or finish
        return "".join(parts), finish

    def usage(self, r: Request, sink: TextSink) -> dict:
        """OpenAI's usage; with --draft also what the drafts did (mkdsl/run/serve_draft.py `usage`)."""
        from mkdsl.run.serve_draft import usage

        done = len(sink.ids)
        plain = {"prompt_tokens": len(r.prompt), "completion_tokens": done, "total_tokens": len(r.prompt) + done}
        return plain | usage(self.engine, r)

    async def completion(self, body):
        prompt = body.prompt if isinstance(body.prompt, str) else _one(body.prompt, "prompt")
        r, sink = self.start(body, prompt)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}
        head["model"] = self.model_id

        def choice(text, finish):
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        if body.stream:

            async def chunks():
                async for text, finish in self.generate(r, sink):
                    yield {**head, "choices": [choice(text, finish)]} if text or finish else None

            return _sse(chunks())
        text, finish = await self.collect(r, sink)
        return {**head, "choices": [choice(text, finish)], "usage": self.usage(r, sink)}

    async def chat(self, body):
        try:
            prompt = self.codec.render([m.model_dump() for m in body.messages])
        except Exception as e:  # no template, or the template refused the conversation
            raise ApiError(400, f"the chat template cannot render these messages: {e}", "messages") from None
        r, sink = self.start(body, prompt)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_id}
        if body.stream:
            chunk = {**head, "object": "chat.completion.chunk"}

            async def chunks():
                yield {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                async for text, finish in self.generate(r, sink):
                    if not (text or finish):
                        yield None
                        continue
                    delta = {"content": text} if text else {}
                    yield {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

            return _sse(chunks())
        text, finish = await self.collect(r, sink)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": self.usage(r, sink)}


def _sse(chunks):
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    from fastapi.responses import StreamingResponse

    async def events():
        async for chunk in chunks:  # None: a token with no text yet, sent as a comment (clients skip it)
            yield ": token\n\n" if chunk is None else f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def build_app(engine: Engine, codec, model_id: str, seq_len: int):
    """The FastAPI app serving `engine` (rows of `seq_len` tokens) as model `model_id`."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    from mkdsl.run.serve_schema import ChatRequest, CompletionRequest

    api = Api(engine, codec, model_id, seq_len)
    app = FastAPI(title="mkdsl", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return JSONResponse(ApiError(400, f"{where or 'body'}: {first.get('msg', 'invalid')}", where).body(), 400)

    @app.exception_handler(Exception)
    async def internal(_, e: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error").body(), 500)

    app.get("/health")(api.health)
    app.get("/v1/models")(api.models)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await api.completion(body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        return await api.chat(body)

    return app


def _one(prompts: list[Any], param: str) -> str:
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise ApiError(
            400, "one prompt string per request (a list of token ids or several prompts is not supported)", param
        )
    return prompts[0]


def run_server(
    spec,
    module,
    weights,
    codec,
    batch: int,
    seq_len: int,
    host: str,
    port: int,
    name: str | None,
    draft: tuple[str, Callable] | None = None,
    **options,
):
    """Serve until interrupted: process 0 runs the engine's thread and the HTTP server; on a
    cluster the other processes follow process 0's calls. `draft`: (its name, a function making
    a request's drafter) for speculative decoding, one process, one row (mkdsl/run/serve_draft.py)."""
    import threading

    import numpy as np

    from mkdsl.run import distributed
    from mkdsl.run.decode import Decoder
    from mkdsl.run.engine import follow
    from mkdsl.run.serve_draft import SpeculativeEngine

    decoder = Decoder(spec, module, weights, batch, seq_len, Sampling(), prefill="xla", **options)
    axes = {t.name: 1 if t.stacked else 0 for t in spec.model.states}
    engine = Engine(decoder, axes) if draft is None else SpeculativeEngine(decoder, axes, draft[1], draft[0])
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        engine.broadcast = lambda x: np.asarray(multihost_utils.broadcast_one_to_all(x))
    if not distributed.is_main():
        follow(engine)
        return
    thread = threading.Thread(target=engine.run, name="mkdsl-engine", daemon=True)
    thread.start()
    import uvicorn

    app = build_app(engine, codec, name or spec.model.name, seq_len)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        engine.stop()
        thread.join(timeout=30)
