"""`kiln serve`: wire the services onto one grpc.aio server and run its lifecycle.

    start:  check limits against the manifest -> bind, start gRPC (health NOT_SERVING)
            -> load + verify the plan, start the engine -> health SERVING
    SIGTERM/SIGINT: health NOT_SERVING, new requests UNAVAILABLE -> in-flight requests
            finish within drain_seconds -> the rest are cancelled -> stop -> exit code
    a second SIGTERM/SIGINT while draining: cancel everything now, stop -> exit 4
    the engine loop dies: health NOT_SERVING, every request UNAVAILABLE (exit 5 on SIGTERM)

Exit codes: 0 drained cleanly; 2 bad settings or plan; 3 the drain time ran out and
requests were cancelled; 4 forced by a second signal; 5 the engine had failed.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tritonclient.grpc import service_pb2 as kserve_pb2
from tritonclient.grpc import service_pb2_grpc as kserve_pb2_grpc

from kiln.contracts import FieldError
from kiln.contracts.manifest import PlanManifest
from kiln.runtime.compute import name_os_thread
from kiln.runtime.engine import Engine, EngineConfig
from kiln.runtime.guided import GuidedLimits
from kiln.runtime.plan import Plan, load_plan, read_manifest
from kiln.runtime.server.auth import BearerToken
from kiln.runtime.server.errors import ServeError
from kiln.runtime.server.frontend import Frontend, State
from kiln.runtime.server.kserve import KServeService
from kiln.runtime.server.limits import RequestLimits
from kiln.runtime.server.metrics import MetricsServer
from kiln.runtime.server.native import NativeService
from kiln.runtime.server.proto import kiln_pb2, kiln_pb2_grpc
from kiln.runtime.speculative import SERVING

if TYPE_CHECKING:
    from kiln.runtime.server.openai_http import HttpServer

log = logging.getLogger("kiln.server")

KSERVE = kserve_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
NATIVE = kiln_pb2.DESCRIPTOR.services_by_name["Kiln"].full_name
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)   # callable without the bearer token
EXIT_OK, EXIT_CANCELLED, EXIT_FORCED, EXIT_ENGINE_FAILED = 0, 3, 4, 5


@dataclass(frozen=True)
class ServeConfig:
    plan: Path
    host: str = "127.0.0.1"
    port: int = 8001
    metrics_port: Optional[int] = 8002       # None: no metrics endpoint
    model_name: Optional[str] = None         # default: the plan's name
    max_batch_size: Optional[int] = None     # limits: lowered only
    max_num_tokens: Optional[int] = None
    max_queue: Optional[int] = None
    max_prefill_tokens_with_decodes: Optional[int] = None   # scheduling trade (scheduler.py)
    drain_seconds: float = 30.0
    tls_cert: Optional[Path] = None
    tls_key: Optional[Path] = None
    auth_token: Optional[str] = None
    http_port: Optional[int] = None          # the OpenAI-compatible HTTP API; None: off
    metrics_host: Optional[str] = None       # default: host
    metrics_auth: bool = False               # the bearer token on the metrics port too
    limits: RequestLimits = RequestLimits()  # per-request caps (runtime/server/limits.py)
    guided: GuidedLimits = GuidedLimits()    # output constraints' costs (runtime/guided.py)
    threads: Optional[int] = None            # the engine thread's compute threads
    expect_digest: Optional[str] = None      # refuse a plan whose plan.json sha256 differs
    speculative: str = "plan"                # the plan's speculative section, or "off"
    draft_plan: Optional[Path] = None        # its draft plan elsewhere than it records
    loras: tuple[tuple[str, Path], ...] = ()  # LoRA adapters (name, PEFT dir) loaded at start
    lora_loading: bool = False               # HTTP routes that load/unload adapters

    def overrides(self) -> dict:
        return {k: getattr(self, k) for k in ("max_batch_size", "max_num_tokens", "max_queue",
                                              "max_prefill_tokens_with_decodes")
                if getattr(self, k) is not None}


def check_config(cfg: ServeConfig) -> tuple[PlanManifest, str]:
    """Validate settings against the manifest before anything binds -> (manifest, model
    name). Raises ServeError."""
    from kiln.runtime.plan import PlanError
    try:
        manifest = read_manifest(cfg.plan, cfg.expect_digest)
    except PlanError as e:
        raise ServeError(str(e))
    try:   # the limits are checked where the engine takes them, reported as flags here
        EngineConfig.from_plan(Plan(Path(cfg.plan), manifest), **cfg.overrides())
    except FieldError as e:
        raise ServeError(f"--{e.field.replace('_', '-')} {e.problem}")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ServeError("TLS needs both --tls-cert and --tls-key")
    if cfg.speculative not in SERVING:
        raise ServeError(f"--speculative {cfg.speculative}: the choices are "
                         f"{', '.join(SERVING)} (the plan's speculative section, or none)")
    spec = manifest.speculative
    how = "off" if cfg.speculative == "off" or spec is None else spec.method
    if cfg.draft_plan is not None and how != "draft":
        raise ServeError(f"--draft-plan {cfg.draft_plan}: a draft plan serves a plan built "
                         f"with speculative method draft; this plan's speculation is {how}")
    _check_loras(cfg, manifest)
    if cfg.auth_token is not None and not cfg.auth_token.strip():
        raise ServeError("--auth-token is empty (an unset variable?): give the token, or "
                         "leave the flag out to serve without auth")
    if cfg.metrics_auth and not cfg.auth_token:
        raise ServeError("--metrics-auth needs --auth-token or --auth-token-file")
    seen: dict[tuple[str, int], str] = {}
    for flag, host, port in _ports(cfg):
        if (host, port) in seen and port != 0:
            raise ServeError(f"{flag} {port} is also {seen[host, port]}")
        seen[host, port] = flag
    return manifest, cfg.model_name or manifest.name


def _check_loras(cfg: ServeConfig, manifest: PlanManifest) -> None:
    """--lora and --allow-lora-loading need a plan built with lora (the latter the HTTP API);
    adapters need names distinct from the served model's."""
    if cfg.lora_loading and (manifest.lora is None or cfg.http_port is None):
        raise ServeError("--allow-lora-loading needs --http-port and a plan built with a lora "
                         "section")
    if not cfg.loras:
        return
    if manifest.lora is None:
        raise ServeError(f"--lora {cfg.loras[0][0]}={cfg.loras[0][1]}: this plan was built "
                         "without a lora section; it serves its base model only")
    names = [n for n, _ in cfg.loras]
    model = cfg.model_name or manifest.name
    dup = next((n for n in names if names.count(n) > 1 or n == model), None)
    if dup is not None:
        raise ServeError(f"--lora {dup}: each adapter needs a name of its own, other than the "
                         f"served model's ({model!r})")


PORT_NAMES = {"--port": "gRPC", "--http-port": "HTTP", "--metrics-port": "metrics"}


def _ports(cfg: ServeConfig) -> list[tuple[str, str, int]]:
    """(flag, host, port) of every port the server listens on (flag: a key of PORT_NAMES)."""
    out = [("--port", cfg.host, cfg.port)]
    if cfg.http_port is not None:
        out.append(("--http-port", cfg.host, cfg.http_port))
    if cfg.metrics_port is not None:
        out.append(("--metrics-port", cfg.metrics_host or cfg.host, cfg.metrics_port))
    return out


@dataclass(frozen=True)
class Tls:
    """The server's certificate chain and key, read and checked once at start."""
    cert: bytes
    key: bytes
    context: ssl.SSLContext     # server side, for the metrics port


def read_tls(cfg: ServeConfig) -> Optional[Tls]:
    """--tls-cert / --tls-key -> Tls (None: plaintext). Raises ServeError when a file cannot
    be read or the two are not a certificate and its private key."""
    if cfg.tls_cert is None:
        return None
    data = {}
    for flag, path in (("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key)):
        try:
            data[flag] = Path(path).read_bytes()
        except OSError as e:
            raise ServeError(f"cannot read {flag} {path}: {e.strerror}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (ssl.SSLError, OSError) as e:
        raise ServeError(f"--tls-cert {cfg.tls_cert} and --tls-key {cfg.tls_key} are not a "
                         f"PEM certificate and its private key "
                         f"({getattr(e, 'reason', None) or e.strerror or e})")
    return Tls(data["--tls-cert"], data["--tls-key"], context)


def check_free(what: str, host: str, port: int) -> None:
    """ServeError naming the port and the reason when (host, port) cannot be bound now.
    gRPC reports only that a bind failed; this says why, before anything starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"cannot listen on {host}:{port} for {what}: {e.strerror}")
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
            try:
                probe.bind(addr)
            except OSError as e:
                raise ServeError(f"cannot listen on {host}:{port} for {what}: {e.strerror}")


def auth_summary(cfg: ServeConfig) -> str:
    """One log line: whether a bearer token is required, and on which ports."""
    named = [(PORT_NAMES[flag], f"{host}:{port}") for flag, host, port in _ports(cfg)]
    if not cfg.auth_token:
        return ("auth: off, no bearer token on any port (" +
                ", ".join(f"{what} {where}" for what, where in named) + ")")
    on = [f"{what} {where}" for what, where in named if what != "metrics" or cfg.metrics_auth]
    open_ = ["gRPC health"] + (["HTTP /health"] if cfg.http_port is not None else [])
    open_ += [f"metrics {where}" for what, where in named
              if what == "metrics" and not cfg.metrics_auth]
    return f"auth: bearer token required on {', '.join(on)}; open: {', '.join(open_)}"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer-token check (metadata `authorization: Bearer TOKEN`); health stays open."""

    def __init__(self, token: str):
        self._token = BearerToken(token)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        if self._token.accepts(dict(details.invocation_metadata or ()).get("authorization")):
            return handler
        return _refusing(handler)


def _refusing(handler):
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    msg = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover  (makes this an async generator)

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


@dataclass
class Listeners:
    """What `listen` bound: the gRPC server and its health service, the HTTP API and the
    metrics port (each None when off)."""
    grpc: grpc.aio.Server
    health: health.aio.HealthServicer
    address: str
    http: Optional[HttpServer] = None
    metrics: Optional[MetricsServer] = None

    async def set_health(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for svc in ("", KSERVE, NATIVE):
            await self.health.set(svc, status)

    async def close(self) -> None:
        """Stop what listens, at once (nothing was served yet, or the drain is over)."""
        await self.grpc.stop(0)
        if self.http is not None:
            await self.http.stop()
        if self.metrics is not None:
            self.metrics.close()


async def serve(cfg: ServeConfig) -> int:
    """Run the server until SIGTERM/SIGINT and a drain; the process's exit code."""
    name_os_thread("kiln-serve")   # the event loop's thread (and the process, in ps/top)
    _, model_name = check_config(cfg)
    tls = read_tls(cfg)
    fe = Frontend(model_name, limits=cfg.limits)
    ports = await listen(cfg, fe, tls)
    log.info("%s", auth_summary(cfg))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = await load_then_ready(cfg, fe, ports, stop)
    if engine is None:      # stopped while loading
        return EXIT_OK
    await stop.wait()
    return await drain_and_stop(cfg, fe, ports, engine)


async def listen(cfg: ServeConfig, fe: Frontend, tls: Optional[Tls]) -> Listeners:
    """Bind every port (gRPC, metrics, HTTP), then start them with health NOT_SERVING:
    requests are answered (UNAVAILABLE / 503) while the plan loads. A port that cannot be
    bound is a ServeError, and then nothing is left listening. With TLS every port speaks it,
    the metrics port included (so --metrics-auth never sends the token in clear)."""
    for flag, host, port in _ports(cfg):
        check_free(PORT_NAMES[flag], host, port)
    ports = _grpc_server(cfg, fe)
    await ports.set_health(False)
    try:
        try:
            if tls is not None:
                bound = ports.grpc.add_secure_port(
                    ports.address, grpc.ssl_server_credentials([(tls.key, tls.cert)]))
            else:
                bound = ports.grpc.add_insecure_port(ports.address)
        except RuntimeError:   # grpc's "Failed to bind" (check_free says why, unless a race)
            bound = 0
        if not bound:
            raise ServeError(f"cannot listen on {ports.address} for gRPC")
        if cfg.metrics_port is not None:
            ports.metrics = fe.metrics.bind(cfg.metrics_host or cfg.host, cfg.metrics_port,
                                            cfg.auth_token if cfg.metrics_auth else None,
                                            tls.context if tls else None)
        if cfg.http_port is not None:   # same loop, same Frontend (engine, metrics, drain)
            from kiln.runtime.server.openai_http import HttpServer
            ports.http = HttpServer(fe, cfg.auth_token, cfg.tls_cert, cfg.tls_key,
                                    cfg.lora_loading)
            await ports.http.start(cfg.host, cfg.http_port)
        await ports.grpc.start()
    except BaseException:
        await ports.close()
        raise
    if ports.metrics is not None:
        ports.metrics.start()
    return ports


def _grpc_server(cfg: ServeConfig, fe: Frontend) -> Listeners:
    """The gRPC server with every service on it, not bound yet; health NOT_SERVING."""
    interceptors = [AuthInterceptor(cfg.auth_token)] if cfg.auth_token else []
    max_message = cfg.limits.max_request_bytes   # larger: RESOURCE_EXHAUSTED, never read
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max(max_message, 64 * 2**20)),
        ("grpc.so_reuseport", 0)])   # a second server on a port in use fails, never shares it
    kserve_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeService(fe), server)
    kiln_pb2_grpc.add_KilnServicer_to_server(NativeService(fe), server)
    health_svc = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_svc, server)
    reflection.enable_server_reflection(
        (KSERVE, NATIVE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return Listeners(server, health_svc, f"{cfg.host}:{cfg.port}")


async def load_then_ready(cfg: ServeConfig, fe: Frontend, ports: Listeners,
                          stop: asyncio.Event) -> Optional[Engine]:
    """Load and verify the plan off the loop, start the engine, health SERVING -> the
    engine; None when `stop` was set while loading (everything is closed then)."""
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    log.info("loading plan %s", cfg.plan)
    load = loop.run_in_executor(None, _load, cfg)
    await asyncio.wait([load, asyncio.ensure_future(stop.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if not load.done():     # stopped while loading
        await ports.close()
        try:
            (await load)[0].shutdown()
        except Exception:
            pass
        return None
    try:
        engine, plan = load.result()
    except Exception as e:
        await ports.close()
        raise ServeError(f"cannot load the plan: {e}") from e
    # What is loaded by now (torch, grpc, the plan, the tokenizer: some 320k objects the
    # collector tracks) lives as long as the server: frozen out of the collector's reach, a
    # full collection while serving scans only what requests made since. Unfrozen, one held
    # the GIL for over a hundred milliseconds (docs/JOURNAL.md): every stream stalled.
    gc.collect()
    gc.freeze()
    fe.set_ready(engine, plan)
    await ports.set_health(True)

    async def engine_failed(reason: str) -> None:
        log.critical("the engine failed (%s): health NOT_SERVING, refusing every request",
                     reason)
        fe.set_failed(reason)
        await ports.set_health(False)

    def on_engine_failure(reason: str) -> None:     # on the engine thread
        try:
            asyncio.run_coroutine_threadsafe(engine_failed(reason), loop)
        except RuntimeError:    # the loop is closed: the server is gone anyway
            pass

    engine.on_failure(on_engine_failure)
    log.info("serving %r on %s (%s, KServe v2 + kiln.v1), metrics on %s; loaded in %.1fs",
             fe.model_name, ports.address, "TLS" if cfg.tls_cert else "plaintext",
             f"{cfg.metrics_host or cfg.host}:{cfg.metrics_port}" if cfg.metrics_port is not None
             else "off",
             time.monotonic() - t0)
    return engine


async def drain_and_stop(cfg: ServeConfig, fe: Frontend, ports: Listeners,
                         engine: Engine) -> int:
    """After the first signal: drain (a second signal forces it), stop every port and the
    engine -> the exit code."""
    loop = asyncio.get_running_loop()
    force = asyncio.Event()       # a second signal: stop draining, cancel everything now
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, force.set)
    failed = fe.state is State.FAILED
    code = await drain(fe, ports.grpc, ports.health, cfg.drain_seconds, force)
    if ports.http is not None:   # drained with the gRPC server: refused new work, then stopped
        await ports.http.stop()
    await loop.run_in_executor(None, engine.shutdown, 10.0)
    if failed or fe.state is State.FAILED:
        code = EXIT_ENGINE_FAILED
    log.info("stopped (exit code %d)", code)
    return code


def _load(cfg: ServeConfig) -> tuple[Engine, Plan]:
    plan = load_plan(cfg.plan, cfg.expect_digest)   # the bytes it runs, checked again
    engine = Engine.from_plan(plan, num_threads=cfg.threads, guided_limits=cfg.guided,
                              speculative=cfg.speculative, draft_plan=cfg.draft_plan,
                              **cfg.overrides())
    try:
        for name, path in cfg.loras:
            engine.adapters.load(name, path)
            log.info("LoRA adapter %s loaded from %s", name, path)
    except ValueError as e:
        engine.shutdown()
        raise ServeError(f"--lora {name}={path}: {e}") from None
    return engine, plan


async def drain(fe: Frontend, server, health_svc, seconds: float,
                force: Optional[asyncio.Event] = None) -> int:
    """Refuse new work, let what was accepted finish, cancel what is left, stop -> the exit
    code: EXIT_OK, EXIT_CANCELLED (the time ran out) or EXIT_FORCED (`force` was set)."""
    fe.start_draining()
    for svc in ("", KSERVE, NATIVE):
        await health_svc.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
    n = len(fe.in_flight)
    log.info("draining: %d requests in flight, up to %.1fs", n, seconds)
    code = EXIT_OK
    if not await fe.wait_idle(seconds, force):
        forced = force is not None and force.is_set()
        code = EXIT_FORCED if forced else EXIT_CANCELLED
        log.warning("%s: cancelling %d requests", "second signal" if forced
                    else "drain time is up", fe.cancel_all())
        await fe.wait_idle(0.5 if forced else 5.0)   # their final (cancelled) responses go out
    await server.stop(grace=0 if code == EXIT_FORCED else 1.0)
    return code


def run(cfg: ServeConfig) -> int:
    """Blocking entry point for the CLI."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s")
    return asyncio.run(serve(cfg))
