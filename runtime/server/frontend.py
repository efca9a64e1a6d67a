"""The one door from the gRPC services to the engine.

Every service submits through `Frontend.request()`, an async context manager, so each
request is counted the same way (metrics), can be found by the drain (in_flight), and is
cancelled in the engine whenever its caller goes away: a client that cancels, a deadline
that passes or a stream that closes all unwind the handler task through the context
manager's exit, which calls stream.cancel(); the engine frees the request's KV blocks
before its next step.

    service handler --request()--> Frontend --submit()--> Engine
          ^                           |  in_flight {id: RequestStream}
          +------ RequestOutput ------+  metrics.observe(last output)
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import time
from typing import AsyncIterator, Optional

from kiln.runtime.engine import Engine, Prompt, RequestOutput, RequestStream
from kiln.runtime.plan import Plan
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.server.errors import ServiceError, classify, unavailable
from kiln.runtime.server.limits import RequestLimits
from kiln.runtime.server.metrics import Metrics


class State(enum.Enum):
    LOADING = "loading"      # the server is up, the plan is not loaded yet
    READY = "ready"
    DRAINING = "draining"    # SIGTERM: finishing what was accepted, refusing the rest
    FAILED = "failed"        # the engine loop died: every request is refused


class Frontend:
    """The served model: its name, plan, engine and lifecycle state."""

    def __init__(self, model_name: str, metrics: Optional[Metrics] = None,
                 limits: Optional[RequestLimits] = None):
        self.model_name = model_name
        self.limits = limits or RequestLimits()
        self.failure: Optional[str] = None
        self.engine: Optional[Engine] = None
        self.plan: Optional[Plan] = None
        self.state = State.LOADING
        self.metrics = metrics or Metrics(lambda: self.engine)
        self.in_flight: dict[str, RequestStream] = {}
        # requests past the readiness check but not in in_flight yet (being tokenized or
        # their constraint compiled, off the loop): accepted, so the drain waits for them
        self.admitting = 0
        self.started = time.time()
        self.last_request_ms = 0
        self._ids = itertools.count()
        self._cancel_all = False

    # ---- lifecycle ---------------------------------------------------------------------------
    def set_ready(self, engine: Engine, plan: Plan) -> None:
        self.engine, self.plan, self.state = engine, plan, State.READY
        self.metrics.ready.set(1)

    def start_draining(self) -> None:
        if self.state is not State.FAILED:
            self.state = State.DRAINING
        self.metrics.ready.set(0)

    def set_failed(self, reason: str) -> None:
        """The engine died (Engine.on_failure): refuse everything from now on."""
        self.state, self.failure = State.FAILED, reason
        self.metrics.ready.set(0)

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    def check_ready(self) -> None:
        if self.state is State.LOADING:
            raise unavailable("the model is still loading; retry when health reports SERVING")
        if self.state is State.DRAINING:
            raise unavailable("the server is shutting down and accepts no new requests")
        if self.state is State.FAILED:
            raise unavailable(f"the engine failed ({self.failure}); the server must be "
                              "restarted")

    async def wait_idle(self, timeout: float, stop: Optional[asyncio.Event] = None) -> bool:
        """Wait until no request is in flight or being admitted (True) or timeout seconds
        pass or `stop` is set (False)."""
        deadline = time.monotonic() + timeout
        while (self.busy and time.monotonic() < deadline and not (stop and stop.is_set())):
            await asyncio.sleep(0.02)
        return not self.busy

    @property
    def busy(self) -> bool:
        return bool(self.in_flight or self.admitting)

    def cancel_all(self) -> int:
        """Cancel every request in flight (each ends with finish_reason 'cancelled'), and
        those still being admitted as they are submitted."""
        self._cancel_all = True
        streams = list(self.in_flight.values())
        for s in streams:
            s.cancel()
        return len(streams)

    # ---- requests ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def request(self, prompt: Prompt, params: SamplingParams
                      ) -> AsyncIterator[tuple[RequestStream, AsyncIterator[RequestOutput]]]:
        """Submit a request -> (its stream, its outputs). Raises ServiceError when refused.
        Must be entered from a coroutine on the server's event loop."""
        try:
            self.check_ready()
            self.limits.check_prompt(prompt, self.engine.config.input_len)
            self.limits.check_params(params)
            self.admitting += 1
            try:
                guide = await self._compile(params)
                stream = await self._submit(prompt, params, f"kiln-{next(self._ids)}", guide)
            finally:
                self.admitting -= 1
        except Exception as e:
            err = classify(e)
            self.metrics.refused(err.outcome)
            raise err from (None if isinstance(e, ServiceError) else e)
        rid = stream.request_id
        if self._cancel_all:
            stream.cancel()
        self.in_flight[rid] = stream
        self.metrics.in_flight.inc()
        self.last_request_ms = int(time.time() * 1000)
        try:
            yield stream, self._outputs(stream)
        finally:
            del self.in_flight[rid]
            self.metrics.in_flight.dec()
            if not stream.finished:     # the caller went away: free the request's blocks
                stream.cancel()
                self.metrics.refused("cancelled")

    async def _compile(self, params: SamplingParams):
        """The request's constraint compiled (on the engine's compile pool, never a thread a
        submission needs), waiting at most the compile deadline; a caller that goes away
        withdraws its compile. None when the request has no constraint."""
        if params.guided is None:
            return None
        if not self.engine.guided_ready:
            await asyncio.to_thread(self.engine.prepare_guided)
        fut = self.engine.compile_guided(params.guided)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut),
                                          self.engine.guided_limits.compile_timeout_s)
        except asyncio.TimeoutError:
            raise self.engine.compile_timeout(params.guided) from None

    async def _submit(self, prompt: Prompt, params: SamplingParams, rid: str,
                      guide=None) -> RequestStream:
        """engine.submit on a worker thread: tokenizing a long prompt (or bad words) never
        stalls the event loop. A caller that goes away meanwhile cancels what it submitted."""
        fut = asyncio.get_running_loop().run_in_executor(None, self.engine.submit, prompt,
                                                         params, rid, guide)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                  or f.result().cancel())
            raise

    async def _outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        async for out in stream:
            if out.finished:
                self.metrics.observe(out)
            yield out
