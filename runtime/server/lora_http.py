"""LoRA adapters loaded and unloaded at run time over HTTP (vLLM's routes), for a server
started with --allow-lora-loading:

    POST /v1/load_lora_adapter    {"lora_name": NAME, "lora_path": DIR}   (PEFT's format)
    POST /v1/unload_lora_adapter  {"lora_name": NAME}

A loaded adapter is served as a model of its own (its name in a request's `model`). A bad
adapter is refused (400) with what is wrong while the server keeps serving; unloading an
adapter that requests use is refused (409): they finish first, then unload it.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request

from kiln.runtime.lora import UnknownAdapterError
from kiln.runtime.server.frontend import Frontend
from kiln.runtime.server.openai_protocol import OpenAIError, invalid


def add_routes(app: FastAPI, fe: Frontend, dependencies: list) -> None:
    """The two routes on `app`, behind `dependencies` (the API's bearer token)."""

    async def body_of(request: Request, *fields: str) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise invalid(f"the request body is not valid JSON: {e}", None, "invalid_json")
        for f in fields:
            if not isinstance(body, dict) or not isinstance(body.get(f), str) or not body[f]:
                raise invalid(f"{f} (a non-empty string) is required", f)
        if fe.engine is None or fe.engine.adapters is None:
            raise invalid("this plan was built without a lora section: it takes no adapters",
                          "lora_name", "lora_not_supported")
        return body

    async def load(request: Request):
        body = await body_of(request, "lora_name", "lora_path")
        name = body["lora_name"]
        if name == fe.model_name:
            raise invalid(f"{name!r} is the served model's name", "lora_name")
        try:
            await asyncio.to_thread(fe.engine.adapters.load, name, body["lora_path"])
        except ValueError as e:
            raise invalid(str(e), "lora_path", "invalid_adapter") from None
        return {"object": "lora_adapter", "id": name, "loaded": True}

    async def unload(request: Request):
        name = (await body_of(request, "lora_name"))["lora_name"]
        try:
            fe.engine.adapters.unload(name)
        except UnknownAdapterError as e:
            raise OpenAIError(404, str(e), "invalid_request_error", "lora_name",
                              "model_not_found") from None
        except ValueError as e:
            raise OpenAIError(409, str(e), "invalid_request_error", "lora_name",
                              "adapter_in_use") from None
        return {"object": "lora_adapter", "id": name, "loaded": False}

    app.add_api_route("/v1/load_lora_adapter", load, methods=["POST"],
                      dependencies=dependencies)
    app.add_api_route("/v1/unload_lora_adapter", unload, methods=["POST"],
                      dependencies=dependencies)
