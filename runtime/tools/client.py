"""A small client of the native kiln.v1 service (what `kiln generate --url` uses)."""
from __future__ import annotations

from typing import Iterator, Optional

import grpc

from kiln.runtime.server.proto import kiln_pb2 as pb
from kiln.runtime.server.proto import kiln_pb2_grpc as pb_grpc


def channel(url: str, tls: bool = False, root_cert: Optional[bytes] = None) -> grpc.Channel:
    opts = [("grpc.max_receive_message_length", 64 * 2**20)]
    if tls:
        return grpc.secure_channel(url, grpc.ssl_channel_credentials(root_cert), options=opts)
    return grpc.insecure_channel(url, options=opts)


def request(prompt: str, max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
            top_k: int = 0, seed: Optional[int] = None, chat: bool = False) -> pb.GenerateRequest:
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k)
    if seed is not None:
        sp.seed = seed
    if chat:
        return pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user",
                                                                        content=prompt)]),
                                  sampling=sp)
    return pb.GenerateRequest(prompt=prompt, sampling=sp)


def stream_generate(url: str, prompt: str, max_tokens: int = 128, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                    chat: bool = False, token: Optional[str] = None,
                    timeout: Optional[float] = None) -> Iterator[str]:
    """Text deltas of one completion from `kiln serve` at url (HOST:PORT) over kiln.v1
    Generate. Raises ValueError for a request the server refuses as invalid, RuntimeError for
    any other failure."""
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with channel(url) as ch:
        stub = pb_grpc.KilnStub(ch)
        req = request(prompt, max_tokens, temperature, top_p, top_k, seed, chat)
        try:
            for chunk in stub.Generate(req, metadata=metadata, timeout=timeout):
                if chunk.error:
                    raise RuntimeError(f"generation failed: {chunk.error}")
                if chunk.text:
                    yield chunk.text
        except grpc.RpcError as e:
            msg = f"{url}: {e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(msg) from None
            raise RuntimeError(msg) from None
