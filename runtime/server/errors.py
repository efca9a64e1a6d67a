"""Errors the services answer with: one exception type carrying its gRPC status code.

Handlers raise ServiceError (or let the engine's own exceptions through `classify`), and each
service turns it into a status (unary/server-streaming RPCs: context.abort) or, inside a
ModelStreamInfer stream, into a response's error_message that leaves the stream open.
"""
from __future__ import annotations

import grpc

from kiln.plugins.inflight_batching import RequestRefused
from kiln.runtime.lora import UnknownAdapterError
from kiln.runtime.engine import EngineError, QueueFullError


class ServeError(RuntimeError):
    """A setting or plan the server cannot start with; the message is for a person."""


class ServiceError(Exception):
    """A request the server refuses; `code` is its gRPC status, the message its reason."""

    def __init__(self, code: grpc.StatusCode, message: str, outcome: str = "invalid"):
        super().__init__(message)
        self.code = code
        self.message = message
        self.outcome = outcome      # the `outcome` label it is counted under in the metrics


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, "invalid")


def not_found(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, message, "not_found")


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, "unavailable")


def classify(exc: BaseException) -> ServiceError:
    """The ServiceError for an exception raised while submitting a request."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, QueueFullError):
        return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "queue_full")
    if isinstance(exc, EngineError):
        return unavailable(str(exc))
    if isinstance(exc, UnknownAdapterError):     # a LoRA adapter that is not loaded
        return not_found(str(exc))
    if isinstance(exc, (RequestRefused, ValueError, UnicodeError)):
        return invalid(str(exc))
    return ServiceError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}", "error")
