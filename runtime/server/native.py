"""The native `kiln.v1.Kiln` service (runtime/server/proto/kiln.proto): Generate streams
token ids, text deltas, finish reason, usage and timings per chunk; Tokenize; GetModelInfo."""
from __future__ import annotations

import asyncio
import json

from kiln.runtime.engine import RequestOutput
from kiln.runtime.guided import GuidedDecoding
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.server.errors import ServiceError, classify, invalid
from kiln.runtime.server.frontend import Frontend
from kiln.runtime.server.proto import kiln_pb2 as pb
from kiln.runtime.server.proto import kiln_pb2_grpc as pb_grpc

_OPTIONAL = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
             "skip_special_tokens", "max_draft_tokens", "adapter")


def sampling_params(p: pb.SamplingParams) -> SamplingParams:
    """The proto's fields that are set, over SamplingParams' defaults."""
    kw = {f: getattr(p, f) for f in _OPTIONAL if p.HasField(f)}
    kw.update(stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids),
              bad_words=tuple(p.bad_words), ignore_eos=p.ignore_eos,
              include_stop_str_in_output=p.include_stop_str_in_output)
    try:
        if p.HasField("guided"):
            kw["guided"] = guided_decoding(p.guided)
        return SamplingParams(**kw)
    except ValueError as e:
        raise invalid(str(e))


def guided_decoding(g: pb.GuidedDecoding) -> GuidedDecoding:
    """The proto's constraint (ValueError when it has none or a bad one)."""
    which = g.WhichOneof("kind")
    if which is None:
        raise ValueError("guided: set one of json_schema, json_object, regex, choice, grammar")
    if which == "json_schema":
        return GuidedDecoding.json_schema(g.json_schema)
    if which == "json_object":
        if not g.json_object:
            raise ValueError("guided.json_object must be true when set")
        return GuidedDecoding("json_object")
    if which == "choice":
        return GuidedDecoding("choice", choices=tuple(g.choice.choices))
    return GuidedDecoding(which, getattr(g, which))


def prompt_of(request):
    """A GenerateRequest's or TokenizeRequest's input: text, chat messages or token ids."""
    which = request.WhichOneof("input")
    if which is None:
        raise invalid("give a prompt, chat messages or token ids")
    if which == "prompt":
        return request.prompt
    if which == "chat":
        if not request.chat.messages:
            raise invalid("chat has no messages")
        return [{"role": m.role, "content": m.content} for m in request.chat.messages]
    return list(request.token_ids.ids)


def chunk(request_id: str, out: RequestOutput) -> pb.GenerateResponse:
    t = out.timings
    timings = pb.Timings(**{k: getattr(t, k) for k in ("queue_time", "ttft", "tpot", "e2e")
                            if getattr(t, k) is not None})
    return pb.GenerateResponse(
        request_id=request_id, token_ids=out.token_ids, text=out.text, finished=out.finished,
        finish_reason=out.finish_reason or "",
        stop_reason="" if out.stop_reason is None else str(out.stop_reason),
        usage=pb.Usage(prompt_tokens=out.usage.prompt_tokens,
                       cached_tokens=out.usage.cached_tokens,
                       completion_tokens=out.usage.completion_tokens,
                       draft_tokens=out.usage.draft_tokens,
                       accepted_draft_tokens=out.usage.accepted_draft_tokens),
        timings=timings, error=out.error or "")


def _tokenize(tok, prompt, add_special_tokens: bool) -> pb.TokenizeResponse:
    """Text or chat messages -> their tokens (ValueError for text or messages the tokenizer
    or the chat template refuses)."""
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        ids = tok.apply_chat_template(prompt, tokenize=True)
    return pb.TokenizeResponse(token_ids=ids, tokens=[tok.token_text(i) for i in ids])


class NativeService(pb_grpc.KilnServicer):
    def __init__(self, frontend: Frontend):
        self.fe = frontend

    async def Generate(self, request, context):
        try:
            try:
                prompt = prompt_of(request)
                params = sampling_params(request.sampling)
            except ServiceError as e:
                self.fe.metrics.refused(e.outcome)
                raise
            async with self.fe.request(prompt, params) as (stream, outputs):
                rid = request.request_id or stream.request_id
                async for out in outputs:
                    yield chunk(rid, out)
        except ServiceError as e:
            await context.abort(e.code, e.message)

    async def Tokenize(self, request, context):
        try:
            self.fe.check_ready()
            tok = self.fe.engine.tokenizer
            prompt = prompt_of(request)
            self.fe.limits.check_prompt(prompt, self.fe.engine.config.input_len)
            if not isinstance(prompt, str) and not (prompt and isinstance(prompt[0], dict)):
                raise invalid("Tokenize takes a prompt or chat messages")
            # tokenized (and the tokens spelled) off the event loop
            return await asyncio.to_thread(_tokenize, tok, prompt, request.add_special_tokens)
        except Exception as e:
            err = classify(e)
            await context.abort(err.code, err.message)

    async def GetModelInfo(self, request, context):
        try:
            self.fe.check_ready()
        except ServiceError as e:
            await context.abort(e.code, e.message)
        engine, plan = self.fe.engine, self.fe.plan
        c = engine.config
        limits = {"max_batch_size": c.max_batch_size, "max_num_tokens": c.max_num_tokens,
                  "max_seq_len": c.max_seq_len, "max_input_len": c.input_len,
                  "max_queue": c.max_queue}
        return pb.ModelInfo(name=self.fe.model_name, fingerprint=plan.fingerprint,
                            manifest_json=json.dumps(plan.manifest.to_json(), sort_keys=True),
                            limits_json=json.dumps(limits, sort_keys=True),
                            has_chat_template=bool(engine.tokenizer.chat_template))
