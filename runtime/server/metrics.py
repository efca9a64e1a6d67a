"""Prometheus metrics (text format on --metrics-port; HTTPS when the server has TLS).

Request-level series are recorded by the Frontend as requests end; engine-level series
(queue, running batch, KV blocks, prefix cache, preemptions, generated, drafted and accepted
tokens) are read from `Engine.stats()` at scrape time, so they are never stale and cost
nothing between scrapes.
"""
from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler, make_wsgi_app

from kiln.runtime.engine import Engine, RequestOutput
from kiln.runtime.server.auth import BearerToken
from kiln.runtime.server.errors import ServeError

# Latency buckets (seconds): sub-millisecond CPU decode steps up to minute-long requests.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_PER_TOKEN = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class _EngineCollector:
    """kiln_* gauges and counters from engine.stats(), taken when scraped."""

    def __init__(self, engine: Callable[[], Optional[Engine]]):
        self._engine = engine

    def collect(self):
        engine = self._engine()
        if engine is None:      # the plan is still loading
            return
        s = engine.stats()
        gauges = {
            "kiln_queue_length": ("requests waiting to be scheduled", s["waiting"]),
            "kiln_running_requests": ("requests in the running batch", s["running"]),
            "kiln_kv_blocks_used": ("KV cache blocks in use", s["kv_blocks_used"]),
            "kiln_kv_blocks_free": ("KV cache blocks free (incl. cached)", s["kv_blocks_free"]),
            "kiln_kv_blocks_cached": ("free KV blocks holding a reusable prefix",
                                      s["kv_blocks_cached"]),
            "kiln_kv_blocks_total": ("KV cache blocks in the pool", s["kv_blocks_total"]),
            "kiln_kv_cache_usage_ratio": ("KV cache blocks in use / blocks in the pool (0 to 1)",
                                          s["kv_blocks_used"] / max(s["kv_blocks_total"], 1)),
            "kiln_prefix_cache_hit_rate": ("prompt tokens served from the prefix cache / "
                                           "prompt tokens looked up", s["prefix_cache_hit_rate"]),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = {
            "kiln_generated_tokens": ("output tokens generated (rate() = tokens/s)",
                                      s["tokens_generated"]),
            "kiln_preemptions": ("sequences preempted (recomputed later) for KV room",
                                 s["preemptions"]),
            "kiln_prefix_cache_queried_tokens": ("prompt tokens looked up in the prefix cache",
                                                 s["prefix_cache_queried_tokens"]),
            "kiln_prefix_cache_hit_tokens": ("prompt tokens found in the prefix cache",
                                             s["prefix_cache_hit_tokens"]),
            "kiln_spec_draft_tokens": ("speculative decoding: draft tokens verified",
                                       s["spec_draft_tokens"]),
            "kiln_spec_accepted_tokens": ("speculative decoding: draft tokens kept (accepted / "
                                          "drafted = acceptance rate)",
                                          s["spec_accepted_tokens"]),
            "kiln_spec_draft_rows": ("speculative decoding: sequence-steps that carried drafts "
                                     "(accepted / rows = mean accepted length)",
                                     s["spec_draft_rows"]),
            "kiln_spec_draft_model_steps": ("speculative decoding: steps of the draft plan "
                                            "(method draft)", s["spec_draft_model_steps"]),
            "kiln_spec_draft_model_positions": ("speculative decoding: tokens the draft plan "
                                                "computed (catch-up and drafts)",
                                                s["spec_draft_model_positions"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value))
        if engine.adapters is not None:
            yield from _lora_metrics(engine.adapters.stats())
            yield _lora_info(*engine.scheduler.adapter_names(), engine.scheduler.max_adapters)


def _lora_info(running: list[str], waiting: list[str], max_lora: int) -> GaugeMetricFamily:
    """The endpoint picker's LoRA-affinity signal, in the form its model-server protocol
    reads (vLLM's lora_requests_info): adapters of running and of waiting requests as
    comma-separated labels, the most one step takes, the scrape time as the value."""
    info = GaugeMetricFamily("kiln_lora_requests_info", "LoRA adapters of running and waiting "
                             "requests (labels) and the most in one step; value: scrape time",
                             labels=["running_lora_adapters", "waiting_lora_adapters",
                                     "max_lora"])
    info.add_metric([",".join(running), ",".join(waiting), str(max_lora)], time.time())
    return info


def _lora_metrics(stats: tuple[int, int, dict[str, int]]):
    """A LoRA plan's adapters: loaded, in use, requests per adapter."""
    loaded, active, requests = stats
    yield GaugeMetricFamily("kiln_lora_adapters_loaded", "LoRA adapters loaded", value=loaded)
    yield GaugeMetricFamily("kiln_lora_adapters_active", "LoRA adapters that requests in "
                            "flight use", value=active)
    per = CounterMetricFamily("kiln_lora_requests", "requests per LoRA adapter",
                              labels=["adapter"])
    for name, n in sorted(requests.items()):
        per.add_metric([name], float(n))
    yield per


class Metrics:
    """The server's registry. `observe(out)` records a finished request."""

    def __init__(self, engine: Callable[[], Optional[Engine]] = lambda: None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kiln_requests", "requests by outcome (stop, length, cancelled, "
                                "error, invalid, not_found, queue_full, unavailable)",
                                ["outcome"], registry=r)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "arrival -> first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("kiln_time_per_output_token_seconds",
                              "mean time per output token after the first, per request",
                              buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("kiln_request_latency_seconds", "arrival -> finished",
                             buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("kiln_queue_time_seconds", "arrival -> first scheduled",
                                    buckets=_LATENCY, registry=r)
        self.in_flight = Gauge("kiln_requests_in_flight",
                               "requests accepted by the server and not yet ended", registry=r)
        self.ready = Gauge("kiln_ready", "1 when the plan is loaded and the server is not "
                           "draining", registry=r)
        r.register(_EngineCollector(engine))

    def observe(self, out: RequestOutput) -> None:
        """A request ended with `out` (its last output)."""
        self.requests.labels(out.finish_reason or "error").inc()
        t = out.timings
        for hist, value in ((self.ttft, t.ttft), (self.tpot, t.tpot), (self.e2e, t.e2e),
                            (self.queue_time, t.queue_time)):
            if value is not None:
                hist.observe(value)

    def refused(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def bind(self, host: str, port: int, auth_token: Optional[str] = None,
             tls: Optional[ssl.SSLContext] = None) -> "MetricsServer":
        """The /metrics HTTP server, bound to (host, port) and not yet serving (start()).
        auth_token: a scrape needs 'Authorization: Bearer TOKEN' (else 401). tls: HTTPS.
        A port that cannot be bound is a ServeError."""
        app = make_wsgi_app(self.registry)
        if auth_token is not None:
            app = _guarded(app, BearerToken(auth_token))
        try:
            return MetricsServer(host, port, app, tls)
        except OSError as e:
            raise ServeError(f"cannot listen on {host}:{port} for metrics: {e.strerror}")


def _guarded(app, token: BearerToken):
    """The WSGI app behind a bearer-token check."""
    def guarded(environ, start_response):
        if token.accepts(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"),
                                            ("Content-Type", "text/plain")])
        return [b"missing or wrong bearer token\n"]
    return guarded


class MetricsServer(ThreadingWSGIServer):
    """Serves /metrics on its own daemon threads (one per connection). With TLS, each
    connection's handshake runs on that connection's thread: a client that never completes
    it holds only its own thread, for at most HANDSHAKE_SECONDS."""

    HANDSHAKE_SECONDS = 10.0

    def __init__(self, host: str, port: int, app, tls: Optional[ssl.SSLContext] = None):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.tls = tls
        self._thread: Optional[threading.Thread] = None
        super().__init__((host, port), _SilentHandler)   # binds and listens
        self.set_app(app)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="kiln-metrics",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving (when started) and release the port."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
        self.server_close()

    def finish_request(self, request, client_address):
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(self.HANDSHAKE_SECONDS)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except OSError:      # not TLS, or gone mid-handshake: nothing to answer
            return None
        try:
            return super().finish_request(conn, client_address)
        finally:
            conn.close()

    def handle_error(self, request, client_address):
        """A scraper that went away mid-answer is not an error of the server."""
