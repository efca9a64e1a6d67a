"""KServe v2 `inference.GRPCInferenceService`, wire-compatible with NVIDIA Triton.

The model's tensors are those of Triton's TensorRT-LLM `ensemble` model, so tritonclient,
perf_analyzer and genai-perf work unchanged. One request = one prompt: tensors have a
leading batch dimension of 1 ([1, 1] for a scalar, [1, n] for a word list), as Triton's
clients send them for a model with max_batch_size > 0.

- ModelInfer (unary): the whole completion in one response.
- ModelStreamInfer (bidirectional): many requests in flight per stream, matched by their
  `id`. With `stream` true, every text delta is a response with parameter
  triton_final_response=false and the last one true; otherwise one final response.
  A request that fails gets a response with error_message; the stream stays open.

text_output follows TensorRT-LLM: unless exclude_input_in_output is true, a unary (or
non-streamed) text_output starts with the prompt text; streamed deltas are new text only,
and concatenate to the completion. num_input_tokens / num_output_tokens (INT32, when asked
for with return_num_input_tokens / return_num_output_tokens): a streamed response counts
the output tokens of its delta (their sum is the total).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import grpc
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from kiln.contracts import KILN_VERSION, FieldError
from kiln.runtime.engine import RequestOutput
from kiln.runtime.guided import GuidedDecoding
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.server.errors import ServiceError, invalid, not_found
from kiln.runtime.server.frontend import Frontend
from kiln.runtime.server.limits import RequestLimits
from kiln.runtime.server.tensors import Tensor, decode_inputs, encode

log = logging.getLogger("kiln.server")


@dataclass(frozen=True)
class InputSpec:
    datatypes: tuple[str, ...]
    words: bool = False            # a list of strings ([1, n]) rather than one element
    required: bool = False


_F32, _I32, _BOOL, _BYTES = ("FP32",), ("INT32",), ("BOOL",), ("BYTES",)
INPUTS: dict[str, InputSpec] = {
    "text_input": InputSpec(_BYTES, required=True),
    "max_tokens": InputSpec(_I32, required=True),
    "stream": InputSpec(_BOOL),
    "temperature": InputSpec(_F32),
    "top_k": InputSpec(_I32),
    "top_p": InputSpec(_F32),              # 0 = off (TensorRT-LLM's meaning)
    "repetition_penalty": InputSpec(_F32),
    "presence_penalty": InputSpec(_F32),
    "frequency_penalty": InputSpec(_F32),
    "length_penalty": InputSpec(_F32),     # beam search only: accepted, no effect at beam 1
    "min_tokens": InputSpec(_I32),
    "min_length": InputSpec(_I32),         # the old name of min_tokens (genai-perf sends it)
    "end_id": InputSpec(_I32),             # an extra stop token
    "pad_id": InputSpec(_I32),             # accepted; nothing is padded
    "beam_width": InputSpec(_I32),         # 1 only
    "seed": InputSpec(("UINT64", "INT64")),
    "random_seed": InputSpec(("UINT64", "INT64")),  # TensorRT-LLM's name of seed
    "stop_words": InputSpec(_BYTES, words=True),
    "bad_words": InputSpec(_BYTES, words=True),
    "exclude_input_in_output": InputSpec(_BOOL),
    "return_num_input_tokens": InputSpec(_BOOL),
    "return_num_output_tokens": InputSpec(_BOOL),
    "ignore_eos": InputSpec(_BOOL),        # genai-perf's --extra-inputs ignore_eos:true
    "max_draft_tokens": InputSpec(_I32),   # speculative drafts a step at most (0: none)
    "lora_name": InputSpec(_BYTES),        # a loaded LoRA adapter (unknown: NOT_FOUND)
    # TensorRT-LLM clients may send these as false; true asks for what is not served
    "return_log_probs": InputSpec(_BOOL),
    "return_context_logits": InputSpec(_BOOL),
    "return_generation_logits": InputSpec(_BOOL),
    # output constraints (at most one; runtime/guided.py): refused at submission when they
    # do not compile
    "guided_json": InputSpec(_BYTES),      # a JSON schema (JSON text), e.g. {"type": "object"}
    "guided_regex": InputSpec(_BYTES),
    "guided_choice": InputSpec(_BYTES, words=True),
    "guided_grammar": InputSpec(_BYTES),   # Lark, or GBNF (rules `name ::= ...`)
}
_UNSERVED = ("return_log_probs", "return_context_logits", "return_generation_logits")
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
OUTPUTS = {"text_output": "BYTES", "num_input_tokens": "INT32", "num_output_tokens": "INT32"}


@dataclass
class KServeRequest:
    """One decoded KServe ModelInferRequest: the prompt, its SamplingParams, what to return."""
    id: str
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool
    outputs: list[str] = field(default_factory=list)   # output names, in response order


def _scalar(t: Tensor):
    return t.values[0]      # check_inputs: one element


def _words(t: Tensor) -> list[str]:
    return [_utf8(t.name, w) for w in t.values if w]


def _utf8(name: str, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"input {name!r} is not valid UTF-8 ({e.reason} at byte {e.start})")


def check_inputs(request, limits: RequestLimits, prompt_bytes: int) -> None:
    """Names, datatypes, shapes and raw byte sizes of a request's inputs, before any element
    is decoded: what decoding then costs is bounded by the caps. Raises ServiceError."""
    raw = request.raw_input_contents
    for i, t in enumerate(request.inputs):
        spec = INPUTS.get(t.name)
        if spec is None:
            raise invalid(f"unknown input {t.name!r}; this model's inputs: {', '.join(INPUTS)}")
        if t.datatype not in spec.datatypes:
            raise invalid(f"input {t.name!r} has datatype {t.datatype}; expected "
                          f"{' or '.join(spec.datatypes)}")
        shape = list(t.shape)
        if spec.words:
            if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)) or shape[-1] < 0:
                raise invalid(f"input {t.name!r} has shape {shape}: expected [1, n] (batch "
                              "size 1, n words) or [n]")
            if t.name == "guided_choice":
                cap, each = limits.max_guided_choices, limits.max_guided_bytes
            else:
                cap = limits.max_stop if t.name == "stop_words" else limits.max_bad_words
                each = limits.max_word_bytes
            limits.check_count(t.name, range(shape[-1]), cap)
            count, most = shape[-1], shape[-1] * each
        else:
            if shape not in ([1, 1], [1]):
                raise invalid(f"input {t.name!r} has shape {shape}: expected [1, 1] (batch "
                              "size 1, one element) or [1]")
            count = 1
            most = (prompt_bytes if t.name == "text_input" else
                    limits.max_guided_bytes if t.name in GUIDED else None)
        payload = len(raw[i]) - 4 * count if i < len(raw) else 0   # less the length words
        if most is not None and payload > most:
            raise invalid(f"input {t.name!r} holds {payload} bytes; at most {most} are "
                          "allowed (a kiln serve limit)")


def parse(request, max_tokens_limit: int, limits: RequestLimits = RequestLimits(),
          max_input_len: Optional[int] = None) -> KServeRequest:
    """Check, decode and validate a ModelInferRequest (the prompt's byte cap follows
    max_input_len when given). Raises ServiceError (INVALID_ARGUMENT)."""
    check_inputs(request, limits, limits.prompt_bytes(max_input_len) if max_input_len
                 else limits.max_request_bytes)
    tensors = decode_inputs(request)
    for name, spec in INPUTS.items():
        if spec.required and name not in tensors:
            raise invalid(f"missing required input {name!r}")
    v = {n: (_words(t) if INPUTS[n].words else _scalar(t)) for n, t in tensors.items()}
    for name, t in tensors.items():   # every float input, used or not (length_penalty)
        if t.datatype == "FP32" and not math.isfinite(v[name]):
            raise invalid(f"input {name!r} = {v[name]}: must be a finite number")
    prompt = _utf8("text_input", v["text_input"])
    max_tokens = v["max_tokens"]
    if max_tokens < 1 or max_tokens > max_tokens_limit:
        raise invalid(f"max_tokens = {max_tokens}: must be in [1, {max_tokens_limit}] (the "
                      "served max_seq_len less one prompt token)")
    if v.get("beam_width", 1) != 1:
        raise invalid(f"beam_width = {v['beam_width']}: only 1 (no beam search) is served")
    for name in _UNSERVED:
        if v.get(name):
            raise invalid(f"{name} = true: log probs and logits are not served")
    if "min_tokens" in v and "min_length" in v and v["min_tokens"] != v["min_length"]:
        raise invalid("min_tokens and min_length (its old name) disagree")
    if "seed" in v and "random_seed" in v and v["seed"] != v["random_seed"]:
        raise invalid("seed and random_seed (its TensorRT-LLM name) disagree")
    kw = {k: v[k] for k in ("temperature", "top_k", "repetition_penalty", "presence_penalty",
                            "frequency_penalty", "max_draft_tokens") if k in v}
    if "top_p" in v:
        kw["top_p"] = v["top_p"] if v["top_p"] > 0 else 1.0
    if "min_tokens" in v or "min_length" in v:
        kw["min_tokens"] = v.get("min_tokens", v.get("min_length"))
    if "seed" in v or "random_seed" in v:
        kw["seed"] = v.get("seed", v.get("random_seed"))
    if "end_id" in v:
        kw["stop_token_ids"] = (v["end_id"],)
    kw["ignore_eos"] = bool(v.get("ignore_eos", False))
    kw["stop"] = tuple(v.get("stop_words", ()))
    kw["bad_words"] = tuple(v.get("bad_words", ()))
    if "lora_name" in v:
        kw["adapter"] = _utf8("lora_name", v["lora_name"]) or None
    try:
        kw["guided"] = _guided(v)
        params = SamplingParams(max_tokens=max_tokens, **kw)
        if v.get("top_k", 0) <= 0 and v.get("top_p", 0.0) <= 0:
            # TensorRT-LLM's rule, which its Triton clients rely on: top_k 0 and top_p 0 (both
            # their defaults) is greedy search, whatever the (valid) temperature; genai-perf
            # and perf_analyzer send neither
            params = replace(params, temperature=0.0)
    except FieldError as e:         # a SamplingParams field is a request input of that name
        raise invalid(f"input {e.field} {e.problem}")
    except ValueError as e:
        raise invalid(str(e))
    outputs = ["text_output"] + [o for o in ("num_input_tokens", "num_output_tokens")
                                 if v.get(f"return_{o}")]
    if request.outputs:
        outputs = [o.name for o in request.outputs]
        unknown = [o for o in outputs if o not in OUTPUTS]
        if unknown:
            raise invalid(f"unknown output {unknown[0]!r}; this model's outputs: "
                          f"{', '.join(OUTPUTS)}")
    return KServeRequest(request.id, prompt, params, bool(v.get("stream", False)),
                         bool(v.get("exclude_input_in_output", False)), outputs)


def _guided(v: dict) -> Optional[GuidedDecoding]:
    """The request's guided_* input, if any (ValueError for two or a bad one)."""
    given = [n for n in GUIDED if n in v]
    if len(given) > 1:
        raise ValueError(f"give one output constraint, not {' and '.join(given)}")
    if not given:
        return None
    name = given[0]
    if name == "guided_choice":
        return GuidedDecoding("choice", choices=tuple(v[name]))
    text = _utf8(name, v[name])
    if name == "guided_json":
        return GuidedDecoding.json_schema(text)
    return GuidedDecoding("regex" if name == "guided_regex" else "grammar", text)


def response(job: KServeRequest, model: str, text: str, num_input: int, num_output: int,
             final: Optional[bool] = None) -> pb.ModelInferResponse:
    """A response carrying every output of `job` in raw_output_contents."""
    values = {"text_output": [text.encode("utf-8")], "num_input_tokens": [num_input],
              "num_output_tokens": [num_output]}
    res = pb.ModelInferResponse(model_name=model, model_version="1", id=job.id)
    for name in job.outputs:
        res.outputs.add(name=name, datatype=OUTPUTS[name], shape=[1, 1])
        res.raw_output_contents.append(encode(OUTPUTS[name], values[name]))
    if final is not None:
        res.parameters["triton_final_response"].bool_param = final
    return res


class KServeService(pb_grpc.GRPCInferenceServiceServicer):
    """inference.GRPCInferenceService over the Frontend."""

    def __init__(self, frontend: Frontend):
        self.fe = frontend
        self.stats = _Stats()

    # ---- server and model metadata -----------------------------------------------------------
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.fe.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="kiln", version=KILN_VERSION,
                                         extensions=["model_configuration", "statistics"])

    def _model(self, name: str, version: str = "") -> None:
        if name != self.fe.model_name:
            raise not_found(f"unknown model {name!r}; this server serves "
                            f"{self.fe.model_name!r}")
        if version not in ("", "1"):
            raise not_found(f"model {name!r} has no version {version!r}; it has version 1")

    async def RepositoryIndex(self, request, context):
        """The served model, then a plan's LoRA adapters (selected with input lora_name)."""
        res = pb.RepositoryIndexResponse()
        state = "READY" if self.fe.ready else "UNAVAILABLE"
        res.models.add(name=self.fe.model_name, version="1", state=state)
        engine = self.fe.engine
        for name in ([] if engine is None or engine.adapters is None
                     else engine.adapters.names()):
            res.models.add(name=name, version="1", state=state, reason=f"LoRA adapter of "
                           f"{self.fe.model_name}: input lora_name={name} selects it")
        return res

    async def ModelReady(self, request, context):
        await self._guard(context, self._model, request.name, request.version)
        return pb.ModelReadyResponse(ready=self.fe.ready)

    async def ModelMetadata(self, request, context):
        await self._guard(context, self._model, request.name, request.version)
        res = pb.ModelMetadataResponse(name=self.fe.model_name, versions=["1"], platform="kiln")
        for name, spec in INPUTS.items():
            res.inputs.add(name=name, datatype=spec.datatypes[0], shape=[-1, -1 if spec.words
                                                                         else 1])
        for name, dt in OUTPUTS.items():
            res.outputs.add(name=name, datatype=dt, shape=[-1, -1 if dt == "BYTES" else 1])
        return res

    async def ModelConfig(self, request, context):
        await self._guard(context, self._model, request.name, request.version)
        cfg = mc.ModelConfig(name=self.fe.model_name, platform="kiln", backend="kiln",
                             max_batch_size=self._limit("max_batch_size", 0))
        cfg.model_transaction_policy.decoupled = True
        types = {"BYTES": mc.TYPE_STRING, "BOOL": mc.TYPE_BOOL, "INT32": mc.TYPE_INT32,
                 "INT64": mc.TYPE_INT64, "UINT64": mc.TYPE_UINT64, "FP32": mc.TYPE_FP32}
        for name, spec in INPUTS.items():
            cfg.input.add(name=name, data_type=types[spec.datatypes[0]],
                          dims=[-1 if spec.words else 1], optional=not spec.required)
        for name, dt in OUTPUTS.items():
            cfg.output.add(name=name, data_type=types[dt], dims=[-1 if dt == "BYTES" else 1])
        return pb.ModelConfigResponse(config=cfg)

    async def ModelStatistics(self, request, context):
        if request.name:
            await self._guard(context, self._model, request.name, request.version)
        return pb.ModelStatisticsResponse(model_stats=[self.stats.proto(self.fe)])

    def _limit(self, name: str, default: int) -> int:
        e = self.fe.engine
        return getattr(e.config, name) if e is not None else default

    async def _guard(self, context, fn, *args):
        try:
            return fn(*args)
        except ServiceError as e:
            await context.abort(e.code, e.message)

    # ---- inference ---------------------------------------------------------------------------
    def _parse(self, request) -> KServeRequest:
        """Decode a request for this model; a refusal is counted and raised (ServiceError)."""
        try:
            self._model(request.model_name, request.model_version)
            self.fe.check_ready()
            return parse(request, self._limit("max_seq_len", 2) - 1, self.fe.limits,
                         self._limit("input_len", 0) or None)
        except ServiceError as e:
            self.fe.metrics.refused(e.outcome)
            raise

    async def ModelInfer(self, request, context):
        t0 = time.monotonic()
        try:
            job = self._parse(request)
            if job.stream:
                self.fe.metrics.refused("invalid")
                raise invalid("stream = true needs the ModelStreamInfer RPC (decoupled model)")
            res = await self._complete(job, t0)
        except ServiceError as e:
            self.stats.fail(t0)
            await context.abort(e.code, e.message)
        return res

    async def _complete(self, job: KServeRequest, t0: float) -> pb.ModelInferResponse:
        """Run a request to its end -> one response (raises ServiceError on failure; a
        success is counted in the statistics)."""
        async with self.fe.request(job.prompt, job.params) as (stream, outputs):
            texts, last = [], None
            async for out in outputs:
                texts.append(out.text)
                last = out
        if last.finish_reason == "error":
            raise ServiceError(grpc.StatusCode.INTERNAL, f"generation failed: {last.error}", "error")
        if last.finish_reason == "cancelled":
            raise ServiceError(grpc.StatusCode.CANCELLED, "the request was cancelled (the "
                               "server is shutting down)", "cancelled")
        text = "".join(texts)
        if not job.exclude_input:
            text = job.prompt + text
        self.stats.success(t0, last)
        return response(job, self.fe.model_name, text, len(stream.prompt_token_ids),
                        last.usage.completion_tokens)

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests are read here and run by one task each; every task writes its own
        responses (one write at a time on the call: `write`). The stream ends when the client
        is done sending and every request has ended; if the call ends first (cancelled,
        deadline), the finally cancels all of them.

        Backpressure: at most limits.max_stream_requests requests run at once (reading stops
        until one ends) and a task waits for its write to be taken (HTTP/2 flow control), so
        a client that writes and never reads is throttled instead of growing the server's
        memory. Writing from the request's task, rather than through a queue to one writer,
        saves each token a queue hand-off and a task switch on the event loop."""
        cap = self.fe.limits.max_stream_requests
        slots = asyncio.Semaphore(cap)
        tasks: set[asyncio.Task] = set()
        lock = asyncio.Lock()

        async def write(message) -> None:
            async with lock:
                await context.write(message)

        try:
            async for request in request_iterator:
                t0 = time.monotonic()
                try:
                    job = self._parse(request)
                except ServiceError as e:
                    self.stats.fail(t0)
                    await write(_error(request.id, e.message))
                    continue
                except Exception as e:         # a defect: this request fails, the stream goes on
                    self.stats.fail(t0)
                    await write(_error(request.id, _internal(request.id, e)))
                    continue
                await slots.acquire()          # released when the request's task ends
                task = asyncio.create_task(self._stream_one(job, write, t0, context))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: slots.release())
                task.add_done_callback(_retrieve)
            while tasks:                       # the client is done sending: finish the rest
                await asyncio.wait(set(tasks))
        finally:
            for t in list(tasks):
                t.cancel()

    async def _stream_one(self, job: KServeRequest, write, t0: float, context) -> None:
        """Run one request of a stream and write its responses; whatever it raises ends it
        alone, reported in its own error_message (the stream and its other requests go on)."""
        try:
            if not job.stream:
                res = await self._complete(job, t0)
                res.parameters["triton_final_response"].bool_param = True
                await write(pb.ModelStreamInferResponse(infer_response=res))
                return
            async with self.fe.request(job.prompt, job.params) as (stream, outputs):
                n_in, carried = len(stream.prompt_token_ids), 0
                async for out in outputs:
                    carried += len(out.token_ids)
                    if out.finished and out.finish_reason in ("error", "cancelled"):
                        raise ServiceError(grpc.StatusCode.INTERNAL, _ended(out), "error")
                    if not out.text and not out.finished:
                        continue          # a partial UTF-8 character: its tokens go next
                    if out.finished:
                        self.stats.success(t0, out)
                    await write(pb.ModelStreamInferResponse(infer_response=response(
                        job, self.fe.model_name, out.text, n_in, carried, out.finished)))
                    carried = 0
        except ServiceError as e:
            self.stats.fail(t0)
            await write(_error(job.id, e.message))
        except Exception as e:
            if context.done():                 # the call has ended: no one to tell
                raise
            self.stats.fail(t0)
            await write(_error(job.id, _internal(job.id, e)))


def _internal(request_id: str, e: Exception) -> str:
    """Log a defect hit while serving one request; -> the error_message its client gets."""
    log.error("KServe stream request %r failed", request_id, exc_info=e)
    return f"internal error: {type(e).__name__}: {e}"


def _retrieve(task: asyncio.Task) -> None:
    """Take a finished request task's exception (a write to a call that has gone away), so
    asyncio does not log it as never retrieved: the call's own end is what reports it."""
    if not task.cancelled():
        task.exception()


def _ended(out: RequestOutput) -> str:
    if out.finish_reason == "cancelled":
        return "the request was cancelled (the server is shutting down)"
    return f"generation failed: {out.error}"


def _error(request_id: str, message: str) -> pb.ModelStreamInferResponse:
    """A stream response reporting one request's failure (the stream stays open)."""
    res = pb.ModelInferResponse(id=request_id)
    res.parameters["triton_final_response"].bool_param = True
    return pb.ModelStreamInferResponse(error_message=message, infer_response=res)


class _Stats:
    """Counts and durations for ModelStatistics (Triton's InferStatistics). Per successful
    request, from its engine timings (perf_analyzer picks the model version whose
    queue.count grows, and reports these as server-side latency):

        queue           arrival in the engine -> first scheduled
        compute_input   first scheduled -> first token (prefill)
        compute_infer   first token -> last token (decode)
        compute_output  the rest of the request's time in the server: decoding the
                        request, submitting it and delivering its responses
    """

    PHASES = ("queue", "compute_input", "compute_infer", "compute_output")

    def __init__(self):
        self.ok = self.failed = 0
        self.ok_ns = self.failed_ns = 0
        self.last_ms = 0
        self.phase_ns = dict.fromkeys(self.PHASES, 0)

    def success(self, t0: float, last: RequestOutput) -> None:
        total = time.monotonic() - t0
        self.ok += 1
        self.ok_ns += int(total * 1e9)
        self.last_ms = int(time.time() * 1000)
        t = last.timings
        queue = t.queue_time or 0.0
        ttft = max(t.ttft or queue, queue)
        e2e = max(t.e2e or ttft, ttft)
        for name, sec in zip(self.PHASES, (queue, ttft - queue, e2e - ttft,
                                           max(0.0, total - e2e))):
            self.phase_ns[name] += int(sec * 1e9)

    def fail(self, t0: float) -> None:
        self.failed += 1
        self.failed_ns += int((time.monotonic() - t0) * 1e9)

    def proto(self, fe: Frontend) -> pb.ModelStatistics:
        s = pb.ModelStatistics(name=fe.model_name, version="1", last_inference=self.last_ms,
                               inference_count=self.ok, execution_count=self.ok)
        s.inference_stats.success.count, s.inference_stats.success.ns = self.ok, self.ok_ns
        s.inference_stats.fail.count, s.inference_stats.fail.ns = self.failed, self.failed_ns
        for name, ns in self.phase_ns.items():
            d = getattr(s.inference_stats, name)
            d.count, d.ns = self.ok, ns
        return s
