"""What a caller gets back from the engine: a RequestStream of RequestOutputs (iterable with
`for` or `async for`), gathered into a RequestResult.

The engine thread delivers with `_put`; a stream read from an asyncio loop gets its outputs
through that loop's LoopPost, any other reader through a thread-safe queue.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kiln.runtime.compute import name_os_thread
from kiln.runtime.sampling import TokenLogprobs


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int       # prompt tokens served from the prefix cache
    completion_tokens: int
    draft_tokens: int = 0           # speculative decoding: draft tokens verified
    accepted_draft_tokens: int = 0  # of those, kept (each an output token)


@dataclass(frozen=True)
class Timings:
    """Seconds; None until known."""
    queue_time: Optional[float] = None   # submit -> first scheduled
    ttft: Optional[float] = None         # submit -> first output token
    tpot: Optional[float] = None         # mean time per output token after the first
    e2e: Optional[float] = None          # submit -> finished


@dataclass(frozen=True)
class RequestOutput:
    """One delivery on a RequestStream: the tokens and text new since the previous one."""
    request_id: str
    token_ids: list[int]                 # new token ids
    text: str                            # new text (never splits a UTF-8 character)
    finished: bool
    finish_reason: Optional[str]         # stop | length | cancelled | error (when finished)
    usage: Usage
    timings: Timings
    stop_reason: Any = None              # the stop token id or stop string, if any
    error: Optional[str] = None          # what went wrong (finish_reason == "error")
    logprobs: Optional[list[TokenLogprobs]] = None  # one per token_ids entry, when asked for


@dataclass
class RequestResult:
    """A whole request, gathered from its stream."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    usage: Usage
    timings: Timings
    stop_reason: Any = None
    error: Optional[str] = None
    logprobs: Optional[list[TokenLogprobs]] = None


_held = threading.local()


def hold_posts() -> None:
    """From now on this thread's LoopPost puts are held until release_posts() (the engine
    thread: it releases them as it launches the compiled step, which runs without the GIL, so
    the serving path runs during the step instead of between steps, where it took turns on
    the GIL with the engine's own Python: `bench/serve_timeline.py`, docs/PERFORMANCE.md)."""
    _held.items = []


def release_posts() -> None:
    """Hand this thread's held outputs to their post threads, in order."""
    items = getattr(_held, "items", None)
    if items:
        _held.items = []
        for post, aq, out in items:
            post._q.put((aq, out))


class LoopPost:
    """Carries outputs from the engine thread into one asyncio loop, without a system call on
    the engine thread.

    call_soon_threadsafe wakes the loop by writing to a socket, and a socket write releases
    the GIL: the loop's thread took it and ran the token's whole serving path (protobuf,
    gRPC write) while the engine thread waited to get it back — measured with py-spy, 4.4% of
    the engine thread's time at one stream. Here the engine thread only appends to a queue
    (no GIL release; held until the next step's launch, see hold_posts); this post thread
    makes the call while the compiled step runs without the GIL, so the loop's work overlaps
    the step instead of lengthening it. Outputs keep their order (one FIFO per loop)."""

    _posts: dict[int, "LoopPost"] = {}
    _posts_lock = threading.Lock()
    IDLE_S = 5.0           # a post thread with nothing to carry this long checks its loop

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kiln-post", daemon=True).start()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopPost":
        with cls._posts_lock:
            post = cls._posts.get(id(loop))
            if post is None or post.loop is not loop:
                post = cls._posts[id(loop)] = cls(loop)
            return post

    def put(self, aq: asyncio.Queue, out: "RequestOutput") -> None:
        held = getattr(_held, "items", None)
        if held is not None:
            held.append((self, aq, out))
        else:
            self._q.put((aq, out))

    def _run(self) -> None:
        name_os_thread("kiln-post")
        while True:
            try:
                batch = [self._q.get(timeout=self.IDLE_S)]
            except queue.Empty:
                if self.loop.is_closed() and self._retire():
                    return
                continue
            while True:     # everything that arrived meanwhile goes in one wake-up
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            try:
                self.loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:   # the loop is closed: nobody is listening any more
                if self._retire():
                    return

    def _retire(self) -> bool:
        """Drop this post from the registry, unless something arrived since."""
        with self._posts_lock:
            if not self._q.empty():
                return False
            if self._posts.get(id(self.loop)) is self:
                del self._posts[id(self.loop)]
            return True


def _deliver(batch: list) -> None:
    for aq, out in batch:
        aq.put_nowait(out)


class RequestStream:
    """The outputs of one request, iterable with `for` or `async for`; `cancel()` ends it."""

    def __init__(self, abort: Callable[[str], None], request_id: str,
                 prompt_token_ids: list[int]):
        """abort(request_id): the engine's cancellation (cancel() calls it)."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._abort = abort
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._aq: Optional[asyncio.Queue] = None
        self._done = False
        try:   # submitted from a coroutine: deliver straight to its loop
            self._bind(asyncio.get_running_loop())
        except RuntimeError:
            pass

    def cancel(self) -> None:
        """Stop the request; its blocks are free before the next step. Idempotent."""
        self._abort(self.request_id)

    @property
    def finished(self) -> bool:
        return self._done

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        if self._aq is not None:
            raise RuntimeError("this stream is bound to an asyncio loop; use `async for`")
        out = self._q.get()
        self._done = out.finished
        return out

    def __aiter__(self):
        self._bind(asyncio.get_running_loop())
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._aq.get()
        self._done = out.finished
        return out

    def result(self) -> RequestResult:
        """Block until the request ends; everything it produced."""
        return _gather(self, list(self))

    async def aresult(self) -> RequestResult:
        return _gather(self, [o async for o in self])

    # engine side ---------------------------------------------------------------------------
    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._loop is loop:
                return
            if self._loop is not None:
                raise RuntimeError("a stream can be read from one asyncio loop only")
            self._loop, self._aq = loop, asyncio.Queue()
            self._post = LoopPost.of(loop)
            while True:     # move what arrived before binding
                try:
                    self._aq.put_nowait(self._q.get_nowait())
                except queue.Empty:
                    break

    def _put(self, out: RequestOutput) -> None:
        with self._lock:
            if self._loop is None:
                self._q.put(out)
                return
            if not self._loop.is_closed():   # closed: nobody is listening any more
                self._post.put(self._aq, out)


def _gather(stream: RequestStream, outs: list[RequestOutput]) -> RequestResult:
    last = outs[-1]
    return RequestResult(stream.request_id, stream.prompt_token_ids,
                         [t for o in outs for t in o.token_ids], "".join(o.text for o in outs),
                         last.finish_reason, last.usage, last.timings, last.stop_reason,
                         last.error, [lp for o in outs for lp in o.logprobs or ()]
                         if any(o.logprobs for o in outs) else None)
