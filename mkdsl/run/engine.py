"""Requests sharing the kernel's rows: what `mkdsl serve` runs behind its HTTP front.

The decode step has B rows, each with its own position, cache and recurrent state. A request
takes a free row (or waits in line for one), is prefilled into that row alone (the other rows'
prompt lengths are 0, so the prefill writes nothing of theirs), then every step feeds each busy
row its last token at its own position; a row whose request ends (its end token, `max_tokens`, a
stop string, or the client gone) is free again, and its recurrent state is zeroed when the next
request takes it. Idle rows are fed token 0 at position 0: their cache is theirs alone and is
rewritten by the next prefill.

The step samples with one `Sampling` and one seed per call, so the rows of one call share them:
a request whose sampling (temperature, top_k, top_p, and the seed unless greedy) differs from the
busy rows' waits until they finish. Greedy requests always share.

On several processes (one per host) process 0 decides each call and broadcasts it
(`jax.experimental.multihost_utils.broadcast_one_to_all`); the other processes make the same
call on their shards (`follow`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mkdsl.run.decode import Decoder
from mkdsl.run.sampling import Sampling

PREFILL, DECODE, STOP = 1, 2, 3  # the calls process 0 broadcasts


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()
    out: queue.Queue = field(default_factory=queue.Queue)  # token ids, then None at the end
    cancelled: threading.Event = field(default_factory=threading.Event)
    finish: str = "length"  # "stop" when an end token came
    accepted: list[int] = field(default_factory=list)  # speculative serving: tokens accepted per verify step

    def key(self) -> tuple:
        """Requests with equal keys can share a call."""
        s = self.sampling
        return (s.temperature, s.top_k, s.top_p, 0 if s.greedy else self.seed)


@dataclass
class Row:
    request: Request
    position: int  # of the token fed next
    token: int  # fed next
    made: int = 1


class Engine:
    """B rows of one Decoder (its weights, state and steps), driven by one thread."""

    ahead = 1  # positions a request's last call may write past its last token (the cache must hold them)
    draft: str | None = None  # the drafter of a speculative engine (mkdsl/run/serve_draft.py)

    def __init__(self, decoder: Decoder, batch_axes: dict[str, int], prefill_bucket: int = 16):
        self.decoder, self.batch = decoder, decoder.batch
        self.batch_axes, self.bucket = batch_axes, prefill_bucket
        self.rows: list[Row | None] = [None] * self.batch
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.broadcast: Callable[[np.ndarray], np.ndarray] | None = None  # set on multi-host
        self._zero = None
        self.left = 0  # requests ended before their end: the client gone (waiting or on a row), a stop string
        self.error: BaseException | None = None

    def submit(self, request: Request) -> Request:
        self.waiting.put(request)
        self.wake.set()
        return request

    def free_rows(self) -> int:
        return sum(r is None for r in self.rows)

    def run(self) -> None:
        """The engine's loop (its own thread), until `stop()`."""
        held: list[Request] = []
        try:
            while not self.stopped.is_set():
                held = self._admit(held)
                self._drop_cancelled()
                if any(self.rows):
                    self._decode()
                else:
                    self.wake.wait(0.1)
                    self.wake.clear()
        except BaseException as e:  # the HTTP side reports it; every waiting request ends
            self.error = e
            for r in [*(row.request for row in self.rows if row), *held, *_drain(self.waiting)]:
                r.out.put(None)
        finally:
            if self.broadcast is not None:
                self.execute(_command(STOP, self.batch, 1))

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()

    def _admit(self, held: list[Request]) -> list[Request]:
        held = held + _drain(self.waiting)
        busy = {row.request.key() for row in self.rows if row}
        new, rest = [], []
        for r in held:
            if r.cancelled.is_set():  # its client left while it waited
                self.left += 1
                r.out.put(None)
                continue
            free = [i for i, row in enumerate(self.rows) if row is None and i not in {j for j, _ in new}]
            if free and (not busy or r.key() in busy) and (not new or r.key() == new[0][1].key()):
                new.append((free[0], r))
                busy = {r.key()}
            else:
                rest.append(r)
        if new:
            self._prefill(new)
        return rest

    def _prefill(self, new: list[tuple[int, Request]]) -> None:
        longest = max(len(r.prompt) for _, r in new)
        width = -(-longest // self.bucket) * self.bucket
        command = _command(PREFILL, self.batch, width, new[0][1])
        tokens, lengths, reset = _body(command, self.batch, width)
        for i, r in new:
            tokens[i, : len(r.prompt)] = r.prompt
            lengths[i], reset[i] = len(r.prompt), 1
        chosen = self.execute(command)
        for i, r in new:
            self.rows[i] = Row(r, len(r.prompt), int(chosen[i]))
            self._emit(i)

    def _decode(self) -> None:
        first = next(row for row in self.rows if row).request
        command = _command(DECODE, self.batch, 1, first)
        tokens, positions, _ = _body(command, self.batch, 1)
        for i, row in enumerate(self.rows):
            if row:
                tokens[i, 0], positions[i] = row.token, row.position
        chosen = self.execute(command)
        for i, row in enumerate(self.rows):
            if row:
                row.token, row.position, row.made = int(chosen[i]), row.position + 1, row.made + 1
                self._emit(i)

    def _emit(self, i: int) -> None:
        """Row i's newest token to its request; the row is freed when the request ends."""
        row = self.rows[i]
        r = row.request
        if r.cancelled.is_set():  # its client left (or a stop string ended it) since the last step
            self.left += 1
        elif row.token in r.stop_ids:
            r.finish = "stop"
        else:
            r.out.put(row.token)
        if r.finish == "stop" or row.made >= r.max_tokens or r.cancelled.is_set():
            r.out.put(None)
            self.rows[i] = None

    def _drop_cancelled(self) -> None:
        for i, row in enumerate(self.rows):
            if row and row.request.cancelled.is_set():
                self.left += 1
                row.request.out.put(None)
                self.rows[i] = None

    def execute(self, command: np.ndarray, broadcast: bool = True) -> np.ndarray:
        """One call, the same on every process: process 0 broadcasts it first (its fixed-size
        head, then its body, whose size the head gives)."""
        if self.broadcast is not None and broadcast:
            head = self.broadcast(command[:HEAD])
            body = self.broadcast(command[HEAD:] if len(command) > HEAD else _empty_body(head, self.batch))
            command = np.concatenate([head, body])
        kind, width, seed, sampling = _head(command)
        if kind == STOP:
            return np.zeros(0, np.int32)
        self.decoder.use_sampling(sampling)
        self.decoder.seed = seed
        tokens, second, reset = _body(np.asarray(command, np.int32), self.batch, width)
        if kind == PREFILL:
            self._reset(reset)
            return self.decoder.prefill(tokens, lengths=second, start=np.zeros_like(second))
        return self.decoder.step_rows(tokens[:, 0], second)[:, 0]

    def _reset(self, rows: np.ndarray) -> None:
        """Zero the state (caches, recurrent state) of the rows about to be prefilled."""
        import jax
        import jax.numpy as jnp

        def zero(state, mask):
            out = {}
            for n, v in state.items():
                axis = self.batch_axes[n]
                keep = jnp.reshape(mask == 0, [-1 if a == axis else 1 for a in range(v.ndim)])
                out[n] = jnp.where(keep, v, jnp.zeros((), v.dtype))
            return out

        if self._zero is None:
            self._zero = jax.jit(zero, donate_argnums=0)
        self.decoder.state = self._zero(self.decoder.state, rows)


def follow(engine: Engine) -> None:
    """A process other than 0: make each call process 0 broadcasts, until it stops."""
    while True:
        head = engine.broadcast(_command(STOP, engine.batch, 0)[:HEAD])
        body = engine.broadcast(_empty_body(head, engine.batch))
        if int(head[0]) == STOP:
            return
        engine.execute(np.concatenate([head, body]), broadcast=False)


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


HEAD = 6  # kind, width, seed, temperature (f32 bits), top_k, top_p (f32 bits)


def _command(kind: int, batch: int, width: int, r: Request | None = None) -> np.ndarray:
    """int32 words (exact through any broadcast): the head, then tokens [batch, width], lengths
    or positions [batch] and the rows to reset [batch]."""
    s = r.sampling if r is not None else Sampling()
    seed = r.seed % 2**32 if r is not None else 0
    floats = np.asarray([s.temperature, s.top_p], np.float32).view(np.int32)
    head = np.asarray([kind, width, np.uint32(seed).view(np.int32), floats[0], s.top_k, floats[1]], np.int32)
    return np.concatenate([head, np.zeros(batch * width + 2 * batch, np.int32)])


def _head(command: np.ndarray) -> tuple[int, int, int, Sampling]:
    """(kind, width, seed, sampling) of a command."""
    temperature, top_p = (float(x) for x in command[[3, 5]].astype(np.int32).view(np.float32))
    seed = int(command[2:3].astype(np.int32).view(np.uint32)[0])
    return int(command[0]), int(command[1]), seed, Sampling(temperature, int(command[4]), top_p)


def _empty_body(head: np.ndarray, batch: int) -> np.ndarray:
    return np.zeros(batch * int(head[1]) + 2 * batch, np.int32)


def _body(command: np.ndarray, batch: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views into a command's tokens [batch, width], lengths or positions [batch], reset [batch]."""
    body = command[HEAD:]
    n = batch * width
    return body[:n].reshape(batch, width), body[n : n + batch], body[n + batch :]
