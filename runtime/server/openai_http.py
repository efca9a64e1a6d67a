"""The OpenAI-compatible HTTP API of `kiln serve --http-port`: FastAPI on uvicorn, a task on
the gRPC server's event loop, submitting through the same Frontend (one engine, one KV pool,
the same metrics, the same drain).

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with stream)
    GET  /v1/models, /v1/models/{model}, /health, /metrics

Every request of n choices is n engine requests of one prompt: the prefix cache shares the
prompt's blocks. A request ends with its HTTP exchange: a client that disconnects (mid-stream
or while waiting for a whole completion) has its engine requests cancelled and their KV
blocks freed before the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
from typing import AsyncIterator, Callable, Optional

import grpc
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.runtime.engine import RequestOutput
from kiln.runtime.server.auth import BearerToken
from kiln.runtime.server.errors import ServeError, ServiceError
from kiln.runtime.server.frontend import Frontend
from kiln.runtime.server.limits import RequestLimits
from kiln.runtime.server.openai_protocol import (FINISH, ChoiceState, OpenAIError, OpenAIRequest,
                                            chunk_json, envelope, final_json, invalid,
                                            parse_chat, parse_completion, usage_json)

log = logging.getLogger("kiln.server.http")

# gRPC status of a refused submission -> (HTTP status, OpenAI error type, code)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "unavailable"),
}


_OUTCOME = {400: "invalid", 404: "not_found", 503: "unavailable"}


def _from_service(e: ServiceError) -> OpenAIError:
    status, kind, code = _STATUS.get(e.code, (500, "server_error", "internal_error"))
    return OpenAIError(status, e.message, kind, None, code)


def _failed(out: RequestOutput) -> OpenAIError:
    """A request that ended without a completion (cancelled by the drain, or an engine error)."""
    if out.finish_reason == "cancelled":
        return OpenAIError(503, "the server is shutting down; the request was cancelled",
                           "service_unavailable", None, "cancelled")
    return OpenAIError(500, f"generation failed: {out.error or out.finish_reason}",
                       "server_error", None, "generation_failed")


def _event(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _merged(outputs: list[AsyncIterator[RequestOutput]]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several requests as they arrive."""
    if len(outputs) == 1:
        async for out in outputs[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, it):
        try:
            async for out in it:
                q.put_nowait((i, out))
        except Exception as e:      # handed to the reader, which raises it
            q.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(outputs)]
    try:
        left = len(outputs)
        while left:
            i, out = await q.get()
            if isinstance(out, Exception):
                raise out
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


class BodyLimit:
    """ASGI middleware: a request body over max_bytes is answered 413 before any of it is
    read when its Content-Length says so, or as soon as a chunked body passes the cap."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body is larger than {self.max_bytes} bytes "
                           "(kiln serve --max-request-bytes)", "invalid_request_error", None,
                           "request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.strip().isdigit()
                                   or int(length) > self.max_bytes):
            body = json.dumps(self._too_large().body()).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited, send)


def _check_body(body: dict, limits: RequestLimits, max_input_len: int) -> None:
    """Caps on the raw body, before it is parsed and tokenized. Raises OpenAIError (400)."""
    try:
        prompt, messages = body.get("prompt"), body.get("messages")
        if isinstance(prompt, str):
            limits.check_prompt(prompt, max_input_len)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            limits.check_prompt(prompt, max_input_len)      # one prompt of token ids
        elif isinstance(prompt, list):
            limits.check_count("prompt", prompt, limits.max_prompts)
            for p in prompt:
                if isinstance(p, (str, list)):
                    limits.check_prompt(p, max_input_len)
        if isinstance(messages, list):
            limits.check_count("messages", messages, limits.max_messages)
            limits.check_prompt([m for m in messages if isinstance(m, dict)] or "",
                                max_input_len, body.get("tools"))
        for name, cap in (("stop", limits.max_stop), ("stop_token_ids", limits.max_stop),
                          ("tools", limits.max_tools), ("guided_choice",
                                                         limits.max_guided_choices)):
            if isinstance(body.get(name), list):
                limits.check_count(name, body[name], cap)
    except ServiceError as e:
        raise invalid(e.message, None, "limit_exceeded")


def _check_logprobs(job: OpenAIRequest, limits: RequestLimits) -> None:
    """A whole response (not streamed, or a streamed reply with tools, sent at its end)
    holds every logprob entry at once: capped."""
    if not job.logprobs or (job.stream and job.tools is None):
        return
    entries = sum(p.max_tokens * (1 + (p.logprobs or 0)) for _, p in job.choices)
    if entries > limits.max_logprob_entries:
        raise invalid(f"choices x max_tokens x (1 + top logprobs) is {entries} logprob "
                      f"entries; at most {limits.max_logprob_entries} are allowed in one "
                      "response (a kiln serve limit): ask for fewer, or stream",
                      "logprobs", "limit_exceeded")


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _json_bytes(obj) -> bytes:
    """JSON as JSONResponse renders it, written a piece at a time: json.dumps is one C call
    that holds the GIL, and a whole response of a million logprob entries in one would
    stall the event loop for seconds (this runs on a worker thread)."""
    out: list[str] = []
    _pieces(obj, out, 0)
    return "".join(out).encode("utf-8")


_OPEN_DEPTH = 4     # response > choices > choice > logprobs > its lists (sliced)
_SLICE = 32         # list items per json.dumps call below that depth


def _pieces(obj, out: list[str], depth: int) -> None:
    if isinstance(obj, dict) and obj and depth < _OPEN_DEPTH:
        sep = "{"
        for k, v in obj.items():
            out.append(f"{sep}{_dumps(str(k))}:")
            _pieces(v, out, depth + 1)
            sep = ","
        out.append("}")
    elif isinstance(obj, list) and obj and (depth < _OPEN_DEPTH or len(obj) > _SLICE):
        for i in range(0, len(obj), 1 if depth < _OPEN_DEPTH else _SLICE):
            out.append("," if i else "[")
            if depth < _OPEN_DEPTH:
                _pieces(obj[i], out, depth + 1)
            else:
                out.append(_dumps(obj[i:i + _SLICE])[1:-1])
        out.append("]")
    else:
        out.append(_dumps(obj))


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIApp:
    """The routes, over one Frontend."""

    def __init__(self, fe: Frontend, auth_token: Optional[str] = None,
                 lora_loading: bool = False):
        self.fe = fe
        self._token = BearerToken(auth_token) if auth_token else None
        self.app = self._build()
        if lora_loading:     # --allow-lora-loading: adapters loaded and unloaded at run time
            from kiln.runtime.server import lora_http

            lora_http.add_routes(self.app, fe, [Depends(self._auth)])

    # ---- wiring ------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="Kiln", docs_url=None, redoc_url=None, openapi_url=None)
        auth = [Depends(self._auth)]
        app.add_exception_handler(OpenAIError, _error_response)
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(Exception, _internal_error)
        app.add_middleware(BodyLimit, max_bytes=self.fe.limits.max_request_bytes)
        app.add_api_route("/health", self.health, methods=["GET"])   # the one open route
        app.add_api_route("/metrics", self.metrics, methods=["GET"], dependencies=auth)
        app.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=auth)
        app.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"],
                          dependencies=auth)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"],
                          dependencies=auth)
        app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"],
                          dependencies=auth)
        return app

    async def _auth(self, request: Request) -> None:
        if self._token is None:
            return
        if not self._token.accepts(request.headers.get("authorization")):
            raise OpenAIError(401, "missing or wrong bearer token (header 'Authorization: "
                              "Bearer <token>', the token of --auth-token)",
                              "authentication_error", None, "invalid_api_key")

    def _ready(self) -> None:
        try:
            self.fe.check_ready()
        except ServiceError as e:
            raise _from_service(e)

    def _adapters(self) -> list[str]:
        """The LoRA adapters served as models of their own (a plan with lora)."""
        engine = self.fe.engine
        return [] if engine is None or engine.adapters is None else engine.adapters.names()

    def _check_model(self, model) -> None:
        if isinstance(model, str) and model != self.fe.model_name \
                and model not in self._adapters():
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                              f"{', '.join(map(repr, [self.fe.model_name, *self._adapters()]))}",
                              "invalid_request_error", "model", "model_not_found")

    def _adapter(self, model) -> Optional[str]:
        """The adapter a request's model names (None: the base model)."""
        return None if model is None or model == self.fe.model_name else model

    @property
    def _fingerprint(self) -> str:
        return "fp_" + self.fe.plan.fingerprint[:12]

    # ---- routes ------------------------------------------------------------------------------
    async def health(self):
        self._ready()
        return {"status": "ok"}

    async def metrics(self):
        return Response(generate_latest(self.fe.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    def _model_card(self, adapter: Optional[str] = None) -> dict:
        card = {"id": adapter or self.fe.model_name, "object": "model",
                "created": int(self.fe.started), "owned_by": "kiln"}
        return card if adapter is None else {**card, "parent": self.fe.model_name}

    async def models(self):
        return {"object": "list", "data": [self._model_card(), *map(self._model_card,
                                                                    self._adapters())]}

    async def model(self, model: str):
        self._check_model(model)
        return self._model_card(self._adapter(model))

    async def completions(self, request: Request):
        return await self._generate(request, lambda body, tok: parse_completion(body, tok))

    async def chat(self, request: Request):
        return await self._generate(request, lambda body, tok: parse_chat(
            body, tok, self.fe.engine.config.max_seq_len))

    # ---- generation --------------------------------------------------------------------------
    async def _generate(self, request: Request, parse: Callable) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise invalid(f"the request body is not valid JSON: {e}", None, "invalid_json")
        except RecursionError:
            raise invalid("the request body nests too deeply", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object", None, "invalid_json")
        try:
            self._ready()
            self._check_model(body.get("model"))
            _check_body(body, self.fe.limits, self.fe.engine.config.input_len)
            # tokenizing (prompts, the chat template) off the event loop
            job: OpenAIRequest = await asyncio.to_thread(parse, body, self.fe.engine.tokenizer)
            if len(job.choices) > self.fe.limits.max_prompts:
                raise invalid(f"{len(job.prompts)} prompts x n = {job.n} is "
                              f"{len(job.choices)} choices; at most "
                              f"{self.fe.limits.max_prompts} are allowed", "n",
                              "limit_exceeded")
            _check_logprobs(job, self.fe.limits)
        except OpenAIError as e:    # counted as the gRPC services count their refusals
            self.fe.metrics.refused(_OUTCOME.get(e.status, "invalid"))
            raise
        if job.stream:
            events = self._events(job)
            await events.__anext__()     # submitted (or refused: an error response)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        whole = asyncio.ensure_future(self._whole(job))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({whole, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not whole.done():        # the client went away: cancel its requests
                whole.cancel()
                await asyncio.gather(whole, return_exceptions=True)
        if whole.cancelled():
            return Response(status_code=499)
        return Response(whole.result(), media_type="application/json")

    async def _submit(self, stack: contextlib.AsyncExitStack, job: OpenAIRequest
                      ) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per choice; a refusal cancels those already submitted."""
        outputs = []
        adapter = self._adapter(job.model)
        for ids, params in job.choices:
            if adapter is not None:
                params = dataclasses.replace(params, adapter=adapter)
            try:
                _, outs = await stack.enter_async_context(self.fe.request(ids, params))
            except ServiceError as e:
                raise _from_service(e)
            outputs.append(outs)
        return outputs

    async def _whole(self, job: OpenAIRequest) -> bytes:
        """The whole response's JSON, made (logprobs' token texts, tool calls) and encoded on
        a worker thread: a large response never stalls the event loop."""
        async with contextlib.AsyncExitStack() as stack:
            outputs = await self._submit(stack, job)
            states = [ChoiceState() for _ in outputs]
            async for i, out in _merged(outputs):
                states[i].add(out)
                if out.finished and out.finish_reason not in FINISH:
                    raise _failed(out)
        tok, fingerprint = self.fe.engine.tokenizer, self._fingerprint
        return await asyncio.to_thread(lambda: _json_bytes(
            final_json(job, states, tok, job.model, fingerprint)))

    async def _events(self, job: OpenAIRequest) -> AsyncIterator[str]:
        """Server-sent events; the first item (empty) marks a successful submission."""
        async with contextlib.AsyncExitStack() as stack:
            outputs = await self._submit(stack, job)
            yield ""
            tok = self.fe.engine.tokenizer
            base = envelope(job, job.model, self._fingerprint, chunk=True)
            states = [ChoiceState() for _ in outputs]
            async for i, out in _merged(outputs):
                if out.finished and out.finish_reason not in FINISH:
                    yield _event(_failed(out).body())
                    return
                chunk = chunk_json(job, i, states[i], out, tok, base)
                if chunk is not None:
                    yield _event(chunk)
            if job.include_usage:
                yield _event({**base, "choices": [],
                              "usage": usage_json([s.usage for s in states], job.n)})
            yield "data: [DONE]\n\n"


async def _error_response(request: Request, e: OpenAIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    msg = (f"unknown path {request.url.path}" if e.status_code == 404 else str(e.detail))
    return JSONResponse(OpenAIError(e.status_code, msg, kind).body(), status_code=e.status_code)


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("HTTP request failed")
    return JSONResponse(OpenAIError(500, f"{type(e).__name__}: {e}", "server_error").body(),
                        status_code=500)


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """kiln serve owns SIGTERM/SIGINT (they start its drain), not uvicorn."""
        yield


class HttpServer:
    """uvicorn serving OpenAIApp as a task on the running loop."""

    def __init__(self, fe: Frontend, auth_token: Optional[str] = None,
                 tls_cert=None, tls_key=None, lora_loading: bool = False):
        self.app = OpenAIApp(fe, auth_token, lora_loading).app
        self.tls = (str(tls_cert), str(tls_key)) if tls_cert else None
        self._server: Optional[_Uvicorn] = None
        self._task: Optional[asyncio.Task] = None

    async def start(self, host: str, port: int) -> None:
        """Bind and start serving; a port that cannot be bound is a ServeError."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ServeError(f"cannot listen on {host}:{port} for HTTP ({e.strerror})")
        sock.listen(2048)
        config = uvicorn.Config(self.app, lifespan="off", log_level="warning",
                                access_log=False, timeout_graceful_shutdown=3,
                                ssl_certfile=self.tls[0] if self.tls else None,
                                ssl_keyfile=self.tls[1] if self.tls else None)
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()
            raise ServeError(f"the HTTP server on {host}:{port} did not start")
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if self.tls else "http",
                 host, port)

    async def stop(self) -> None:
        """Stop accepting, close connections (after the drain, none is busy)."""
        if self._server is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, 10)
        except (asyncio.TimeoutError, Exception):
            log.warning("the HTTP server did not stop cleanly", exc_info=True)
