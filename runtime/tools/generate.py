"""`kiln generate`: stream one completion, from a plan in-process or from a running server."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

from kiln.runtime.sampling import SamplingParams


def generate_stream(plan: Optional[Path], prompt: str, url: Optional[str] = None,
                    max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                    top_k: int = 0, seed: Optional[int] = None,
                    chat: bool = False) -> Iterator[str]:
    """Yield text deltas. In-process (plan) through the same Engine the server runs, or over
    gRPC (url, kiln.v1 Generate)."""
    if url is not None:
        from kiln.runtime.tools.client import stream_generate

        yield from stream_generate(url, prompt, max_tokens=max_tokens, temperature=temperature,
                                   top_p=top_p, top_k=top_k, seed=seed, chat=chat)
        return
    if plan is None:
        raise ValueError("give a plan directory, or --url HOST:PORT of a running kiln serve")
    from kiln.runtime.engine import Engine

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed)
    engine = Engine.from_plan(plan)
    try:
        request = [{"role": "user", "content": prompt}] if chat else prompt
        stream = engine.submit(request, params)
        for out in stream:
            if out.error:
                raise RuntimeError(f"generation failed: {out.error}")
            if out.text:
                yield out.text
    finally:
        engine.shutdown()
