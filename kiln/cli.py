"""The `kiln` command. A thin layer: the builder is imported only inside building commands,
so `kiln serve` / `kiln generate` run where only the runtime's dependencies are installed."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Kiln: build LLM inference plans ahead of time, then serve them.")


PREFILL_HELP = ("prefill tokens a step with running decodes may add (default: the rest of "
                "max_num_tokens); lower: steadier inter-token latency while prompts arrive, "
                "later first tokens, less throughput (docs/SERVING.md)")
DRAFT_PLAN_HELP = ("the draft plan of a plan built with speculative method draft, where it "
                   "is not at the path the plan records")
LORA_HELP = ("load a LoRA adapter in PEFT's format (a plan built with lora); requests name it "
             "as their model. Repeatable")
LORA_LOAD_HELP = ("HTTP routes /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters "
                  "read from this host's paths at run time")


def _fail(message: str, code: int = 1):
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def build(spec: Path = typer.Argument(..., help="the spec YAML"),
          out: Optional[Path] = typer.Option(None, "--out", "-o",
                                             help="plan directory (default plans/NAME)"),
          force: bool = typer.Option(False, "--force", help="rebuild even if up to date"),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
          max_memory: Optional[str] = typer.Option(
              None, "--max-memory", help="memory the build may use (e.g. 20GiB), instead of "
              "what the machine has available; a build expected to need more is refused")):
    """Build a plan from a spec (skipped when the plan is up to date)."""
    from kiln.builder.build import BuildError, build as do_build
    from kiln.builder.memory import parse_bytes
    from kiln.builder.progress import Progress
    from kiln.builder.spec import SpecError

    try:
        limit = None if max_memory is None else parse_bytes(max_memory, "--max-memory")
    except ValueError as e:
        _fail(str(e), 2)
    try:
        res = do_build(spec, out, force=force, progress=Progress(enabled=not quiet),
                       max_memory=limit)
    except SpecError as e:
        _fail(str(e), 2)
    except Exception as e:
        from kiln.builder.sources import CheckpointError  # imports torch: only on this path

        if isinstance(e, (CheckpointError, BuildError)):
            if getattr(e, "abandon_process", False):   # BuildError's: no finalizers
                typer.echo(f"error: {e}", err=True)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
            _fail(str(e), 1)
        raise
    if res.rebuilt:
        typer.echo(f"built {res.path} (fingerprint {res.fingerprint[:16]}) in {res.seconds:.1f}s")
    else:
        typer.echo(f"{res.path} is up to date (fingerprint {res.fingerprint[:16]}); "
                   "use --force to rebuild")


@app.command()
def inspect(plan: Path = typer.Argument(..., help="a plan directory"),
            as_json: bool = typer.Option(False, "--json", help="the whole manifest as JSON")):
    """Show a plan's manifest."""
    from kiln.runtime.tools.inspect import describe
    from kiln.runtime.plan import PlanError, read_manifest

    try:
        manifest = read_manifest(plan)
    except PlanError as e:
        _fail(str(e))
    if as_json:
        typer.echo(manifest.dumps())
    else:
        typer.echo(describe(manifest, plan))


@app.command()
def verify(plan: Path = typer.Argument(..., help="a plan directory")):
    """Verify a plan loads here (format, target, toolchain, checksums) and generates;
    re-runs the accuracy gate when the plan has one."""
    from kiln.runtime.plan import PlanError, load_plan
    from kiln.runtime.tools.verify import verify_plan

    try:
        p = load_plan(plan)
        report = verify_plan(p)
    except PlanError as e:
        _fail(str(e))
    typer.echo(report.text)
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def generate(
    args: List[str] = typer.Argument(..., metavar="[PLAN] PROMPT",
                                     help="a plan directory (in-process; omit with --url) "
                                          "and the prompt"),
    url: Optional[str] = typer.Option(None, "--url", help="HOST:PORT of a running kiln serve"),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    chat: bool = typer.Option(False, "--chat", help="apply the plan's chat template"),
):
    """Generate text from a plan, streamed to stdout."""
    from kiln.runtime.tools.generate import generate_stream

    if len(args) > 2:
        _fail("give at most a plan directory and one prompt (quote the prompt)", 2)
    plan, prompt = (Path(args[0]) if len(args) == 2 else None), args[-1]

    try:
        for delta in generate_stream(plan, prompt, url=url, max_tokens=max_tokens,
                                     temperature=temperature, top_p=top_p, top_k=top_k,
                                     seed=seed, chat=chat):
            sys.stdout.write(delta)
            sys.stdout.flush()
    except (ValueError, RuntimeError) as e:
        _fail(str(e))
    sys.stdout.write("\n")


def _auth_token(token: Optional[str], token_file: Optional[Path]) -> Optional[str]:
    """--auth-token / --auth-token-file -> the bearer token; None: auth is off."""
    if token is not None and token_file:
        _fail("give --auth-token or --auth-token-file, not both", 2)
    if token_file:
        token = token_file.read_text().strip()
        if not token:
            _fail(f"{token_file} is empty", 2)
    return token


@app.command()
def serve(
    plan: Path = typer.Argument(..., help="a plan directory"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8001, "--port", help="gRPC port (KServe v2, kiln.v1, health)"),
    metrics_port: int = typer.Option(8002, "--metrics-port", help="Prometheus /metrics port"),
    model_name: Optional[str] = typer.Option(None, "--model-name",
                                             help="KServe model name (default: the plan's)"),
    max_batch_size: Optional[int] = typer.Option(None, "--max-batch-size",
                                                 help="lower the plan's limit"),
    max_num_tokens: Optional[int] = typer.Option(None, "--max-num-tokens",
                                                 help="lower the plan's limit"),
    max_queue: Optional[int] = typer.Option(None, "--max-queue",
                                            help="lower the plan's waiting-queue bound"),
    max_prefill_tokens_with_decodes: Optional[int] = typer.Option(None, help=PREFILL_HELP),
    drain_seconds: float = typer.Option(30.0, "--drain-seconds",
                                        help="on SIGTERM, time for in-flight requests"),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert"),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key"),
    auth_token: Optional[str] = typer.Option(None, "--auth-token",
                                             help="require 'authorization: Bearer TOKEN'"),
    auth_token_file: Optional[Path] = typer.Option(None, "--auth-token-file"),
    http_port: Optional[int] = typer.Option(None, "--http-port",
                                            help="also serve the OpenAI-compatible HTTP API "
                                                 "(/v1/completions, /v1/chat/completions) here"),
    metrics_host: Optional[str] = typer.Option(None, "--metrics-host",
                                               help="bind the metrics port here (default: "
                                                    "--host)"),
    metrics_auth: bool = typer.Option(False, "--metrics-auth", help="bearer token on /metrics too"),
    max_request_bytes: int = typer.Option(16 * 2**20, "--max-request-bytes",
                                          help="largest HTTP body / gRPC message (413 / "
                                               "RESOURCE_EXHAUSTED beyond)"),
    max_prompt_bytes: Optional[int] = typer.Option(
        None, "--max-prompt-bytes", help="largest prompt text, refused before tokenizing "
                                         "(default 64 x max_input_len, at least 1 MiB)"),
    max_stop: int = typer.Option(64, "--max-stop", help="stop strings (and stop token ids) "
                                                        "per request"),
    max_bad_words: int = typer.Option(64, "--max-bad-words", help="bad words per request"),
    max_prompts: int = typer.Option(64, "--max-prompts",
                                    help="prompts x n choices per OpenAI request"),
    max_messages: int = typer.Option(1024, "--max-messages", help="chat messages per request"),
    max_stream_requests: int = typer.Option(
        64, "--max-stream-requests", help="requests in flight per KServe ModelStreamInfer "
                                          "stream; more are not read until one ends"),
    max_logprob_entries: int = typer.Option(
        1 << 20, "--max-logprob-entries", help="choices x max_tokens x (1 + top logprobs) of "
                                               "one OpenAI response that is not streamed"),
    max_guided_bytes: int = typer.Option(256 * 2**10, help="one output constraint's text"),
    max_guided_choices: int = typer.Option(256, help="guided_choice entries per request"),
    max_tools: int = typer.Option(128, help="OpenAI tools per request"),
    guided_compile_threads: int = typer.Option(2, help="threads compiling constraints"),
    guided_max_compiles_waiting: int = typer.Option(64, help="compiles queued; more: retry"),
    guided_compile_timeout_s: float = typer.Option(10.0, "--guided-compile-timeout",
                                                   help="a compile's deadline, seconds"),
    guided_cache_bytes: int = typer.Option(512 * 2**20, help="compiled constraints kept"),
    guided_step_budget_ms: float = typer.Option(50.0, help="mask time per engine step"),
    threads: Optional[int] = typer.Option(
        None, "--threads", min=1, help="compute threads of the engine (default: "
        "OMP_NUM_THREADS, else this process's cores); every other thread computes "
        "single-threaded"),
    expect_digest: Optional[str] = typer.Option(
        None, "--expect-digest", metavar="SHA256", help="refuse the plan unless the sha256 of "
        "its plan.json is this (kiln ci current NAME --digest)"),
    speculative: str = typer.Option(
        "plan", "--speculative", metavar="plan|off", help="speculative decoding: as the plan "
        "was built (its speculative section, if any), or off"),
    draft_plan: Optional[Path] = typer.Option(None, metavar="DIR", help=DRAFT_PLAN_HELP),
    lora: list[str] = typer.Option([], "--lora", metavar="NAME=DIR", help=LORA_HELP),
    allow_lora_loading: bool = typer.Option(False, "--allow-lora-loading", help=LORA_LOAD_HELP),
):
    """Serve a plan over gRPC (KServe v2 / Triton, kiln.v1, health, reflection) until
    SIGTERM or SIGINT."""
    from kiln.runtime.compute import claim_process
    threads = claim_process(threads)   # before torch is imported
    from kiln.runtime.server.app import ServeError, run
    cfg = _serve_config(dict(locals()))
    try:
        code = run(cfg)
    except ServeError as e:
        _fail(str(e), 2)
    raise typer.Exit(code)


def _loras(args: list[str]) -> tuple:
    """--lora NAME=DIR values -> ((name, dir), ...); a bad one exits 2."""
    out = []
    for v in args:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            _fail(f"--lora {v}: expected NAME=DIR (an adapter name and its PEFT directory)", 2)
        out.append((name, Path(path)))
    return tuple(out)


def _serve_config(a: dict):
    """The ServeConfig of `kiln serve`'s arguments; a bad cap exits 2 naming its flag."""
    from kiln.contracts import FieldError
    from kiln.runtime.guided import GuidedLimits
    from kiln.runtime.server.app import ServeConfig
    from kiln.runtime.server.limits import RequestLimits

    cfg = ServeConfig(plan=a["plan"], host=a["host"], port=a["port"],
                      metrics_port=a["metrics_port"], model_name=a["model_name"],
                      max_batch_size=a["max_batch_size"], max_num_tokens=a["max_num_tokens"],
                      max_queue=a["max_queue"],
                      max_prefill_tokens_with_decodes=a["max_prefill_tokens_with_decodes"],
                      drain_seconds=a["drain_seconds"],
                      tls_cert=a["tls_cert"], tls_key=a["tls_key"],
                      auth_token=_auth_token(a["auth_token"], a["auth_token_file"]),
                      http_port=a["http_port"], metrics_host=a["metrics_host"],
                      metrics_auth=a["metrics_auth"], threads=a["threads"],
                      expect_digest=a["expect_digest"], speculative=a["speculative"],
                      draft_plan=a["draft_plan"], loras=_loras(a["lora"]),
                      lora_loading=a["allow_lora_loading"])
    try:   # the caps: each flag is its field's name (guided: --guided-NAME)
        cfg = dataclasses.replace(cfg, limits=RequestLimits(**{
            f.name: a[f.name] for f in dataclasses.fields(RequestLimits) if f.name in a}))
    except FieldError as e:
        _fail(f"--{e.field.replace('_', '-')} {e.problem}", 2)
    try:
        cfg = dataclasses.replace(cfg, guided=GuidedLimits(**{
            f.name: a["guided_" + f.name] for f in dataclasses.fields(GuidedLimits)
            if "guided_" + f.name in a}))
    except FieldError as e:
        _fail(f"--guided-{e.field.removesuffix('_s').replace('_', '-')} {e.problem}", 2)
    return cfg


@app.command()
def bench(
    plan: Optional[Path] = typer.Argument(None, help="a plan directory (with --offline)"),
    offline: bool = typer.Option(False, "--offline", help="drive the engine in-process"),
    url: Optional[str] = typer.Option(None, "--url", help="HOST:PORT of a running kiln serve"),
    requests: int = typer.Option(64, "--requests", help="requests per concurrency level"),
    output_len: int = typer.Option(128, "--output-len", help="output tokens per request"),
    concurrency: List[int] = typer.Option([1, 8, 32], "--concurrency", "-c"),
    naive_requests: int = typer.Option(8, "--naive-requests",
                                       help="requests the naive HF baseline runs (it is "
                                            "serial; its tokens/s does not depend on it)"),
    seed: int = typer.Option(0, "--seed"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="write results as JSON"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG plot (with --url)"),
    threads: Optional[int] = typer.Option(
        None, "--threads", min=1, help="with --offline: compute threads of the engine and of "
        "the naive baseline (default: OMP_NUM_THREADS, else this process's cores), laid out "
        "as `kiln serve` does"),
):
    """Benchmark a plan in-process (--offline) or a running server over gRPC (--url)."""
    if offline == (url is not None):
        _fail("choose one of --offline PLAN or --url HOST:PORT", 2)
    if offline:
        if plan is None:
            _fail("--offline needs a plan directory", 2)
        from kiln.runtime.compute import claim_process

        threads = claim_process(threads)   # before torch is imported, as for kiln serve
        from kiln.runtime.tools.bench import run_offline
        from kiln.runtime.plan import PlanError

        try:
            run_offline(plan, requests=requests, output_len=output_len,
                        concurrencies=tuple(concurrency), seed=seed,
                        json_path=str(json_path) if json_path else None,
                        naive_requests=max(1, naive_requests), threads=threads)
        except (PlanError, ValueError) as e:
            _fail(str(e))
        return
    from kiln.runtime.tools.loadgen import run_loadgen

    run_loadgen(url, requests=requests, output_len=output_len,
                concurrencies=tuple(concurrency), seed=seed,
                json_path=str(json_path) if json_path else None,
                plot_path=str(plot) if plot else None)


@app.command()
def package(plan: Path = typer.Argument(..., help="a plan directory"),
            oci: Path = typer.Option(..., "--oci", help="write an OCI image layout here (a new "
                                     "or empty directory)"),
            modelcar: bool = typer.Option(False, "--modelcar", help="add a static busybox "
                                          "layer (sh) so KServe can run it as a modelcar"),
            busybox_deb: Optional[Path] = typer.Option(
                None, "--busybox-deb", help="Debian's busybox-static .deb for --modelcar "
                "(default: the newest in ~/.cache/kiln/debs, then /var/cache/apt/archives)")):
    """Package a plan as a deterministic OCI image (the plan under /models/NAME): usable as a
    Kubernetes image volume, or with --modelcar as a KServe modelcar (storageUri oci://...).
    Prints the manifest digest."""
    from kiln.runtime.tools.package import PackageError, package_plan

    try:
        done = package_plan(plan, oci, modelcar=modelcar, busybox_deb=busybox_deb)
    except PackageError as e:
        _fail(str(e))
    shell = f"shell layer {done.shell.digest}, " if done.shell else ""
    typer.echo(f"packaged {done.name} into {oci}: manifest {done.manifest.digest}, {shell}"
               f"layer {done.layer.digest} ({done.layer.size} bytes), plan digest "
               f"{done.plan_digest}")
    store = _containing_store(plan)
    if store is not None:
        from kiln.builder.plan_ci.store import PlanStore

        PlanStore(store).record_package(done.fingerprint, done.manifest.digest,
                                        done.layer.digest, done.plan_digest)
        typer.echo(f"recorded in {store}/packages/{done.fingerprint}.json")


def _containing_store(plan: Path) -> Optional[Path]:
    """The kiln ci store whose plans/<fingerprint>/ `plan` is, if any."""
    plan = plan.resolve()
    root = plan.parent.parent
    if plan.parent.name == "plans" and (root / "current").is_dir():
        return root
    return None


@app.command()
def unpack(layout: Path = typer.Argument(..., help="an OCI layout written by kiln package"),
           out: Path = typer.Option(..., "--out", help="unpack the plan here (new or empty)"),
           expect_digest: Optional[str] = typer.Option(None, "--expect-digest",
                                                       metavar="SHA256")):
    """Check an OCI plan image (every blob against its digest), unpack the plan and verify it
    loads here like any plan."""
    from kiln.runtime.plan import PlanError
    from kiln.runtime.tools.package import PackageError, load_packaged

    try:
        p = load_packaged(layout, out, expect_digest=expect_digest)
    except (PackageError, PlanError) as e:
        _fail(str(e))
    typer.echo(f"unpacked {p.name} into {p.path} (plan digest {p.digest})")

@app.command()
def deploy(plan: Path = typer.Argument(..., help="a plan directory"),
           out: Path = typer.Option(..., "--out", help="write the Helm chart under here"),
           values: Optional[Path] = typer.Option(None, "--values",
                                                 help="YAML values laid over the plan's")):
    """Write a Helm chart serving the plan (Deployment, Service, probes, PodDisruptionBudget,
    queue-depth autoscaling, KServe runtime), sized from its manifest."""
    from kiln.runtime.tools.deploy import DeployError, write_chart

    try:
        chart = write_chart(plan, out, values)
    except DeployError as e:
        _fail(str(e))
    typer.echo(f"wrote chart {chart}")

from kiln.ci_cli import app as ci_app  # noqa: E402  (builder.plan_ci is imported inside its commands)

app.add_typer(ci_app, name="ci")


def main():
    app()


if __name__ == "__main__":
    main()
