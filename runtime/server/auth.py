"""The bearer-token check, the same on every port: gRPC metadata (app.AuthInterceptor), the
OpenAI-compatible HTTP API (openai_http) and the metrics port (metrics, with --metrics-auth)."""
from __future__ import annotations

import hmac
from typing import Optional, Union


class BearerToken:
    """Accepts `Authorization: Bearer TOKEN` for one token, compared in constant time."""

    def __init__(self, token: str):
        if not token.strip():    # "Bearer " would be the token: refused, never auth off
            raise ValueError("the bearer token is empty")
        self._expected = f"Bearer {token}".encode()

    def accepts(self, header: Optional[Union[str, bytes]]) -> bool:
        """header: the authorization header / metadata value as received (None: absent)."""
        got = header.encode() if isinstance(header, str) else (header or b"")
        return hmac.compare_digest(got, self._expected)
