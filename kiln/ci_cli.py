"""`kiln ci ...`: the typer sub-app. A thin layer over builder.plan_ci (imported inside commands)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Rebuild, verify and publish plans whenever a spec, its weights, the "
                       "toolchain or the target changes.")

SPECS = typer.Option(Path("model_specs"), "--specs", help="a folder of spec YAMLs (or one spec)")
STORE = typer.Option(Path("kiln-store"), "--store", help="the plan store directory")
TARGET = typer.Option(None, "--target", help="only specs whose target.device is this "
                      "(cpu, h100, ...): one CI job per runner kind")


def _fail(message: str, code: int = 1):
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _specs(folder: Path) -> list[Path]:
    from kiln.builder.plan_ci.assess import find_specs

    if not folder.exists():
        _fail(f"{folder}: no such spec folder (give one with --specs)", 2)
    found = find_specs(folder)
    if not found:
        _fail(f"{folder}: no *.yaml specs there", 2)
    return found


@app.command("plan")
def plan_cmd(specs: Path = SPECS, store: Path = STORE, target: Optional[str] = TARGET,
             as_json: bool = typer.Option(False, "--json", help="machine-readable output "
                                          "(per spec, build targets, CI matrix, cache key)"),
             full: bool = typer.Option(False, "--full", help="compute every fingerprint "
                                       "(ignore quick keys)")):
    """Dry run: print what `kiln ci rebuild` would rebuild and why. Builds nothing."""
    from kiln.builder.plan_ci.pipeline import CIOptions, dry_run

    plan = dry_run(_specs(specs), CIOptions(store=store, full=full, target=target))
    if as_json:
        typer.echo(json.dumps(plan.to_json(), indent=2, sort_keys=True))
        return
    for a in plan.specs:
        label = a.name or str(a.spec_path)
        fp = f" {a.fingerprint[:12]}" if a.fingerprint else ""
        typer.echo(f"{a.action:<6} {label}{fp}: {a.reason}")
        for c in a.changed:
            typer.echo(f"         {c.input}: {c.detail}")
        if a.error:
            typer.echo("         " + a.error.replace("\n", "\n         "))
    c = plan.counts()
    typer.echo(f"{c['build']} to build, {c['reuse']} to reuse, {c['fail']} failing")


@app.command("rebuild")
def rebuild_cmd(specs: Path = SPECS, store: Path = STORE, target: Optional[str] = TARGET,
                jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="builds at once"),
                keep: int = typer.Option(3, "--keep", min=1, help="plans kept per spec; the "
                                         "current one is never removed"),
                report: Optional[Path] = typer.Option(None, "--report", help="write the "
                                                      "markdown summary here"),
                json_out: Optional[Path] = typer.Option(None, "--json", help="write the JSON "
                                                        "report here"),
                full: bool = typer.Option(False, "--full", help="compute every fingerprint "
                                          "(ignore quick keys)"),
                oci: bool = typer.Option(False, "--oci", help="publish each current plan's OCI "
                                         "image (kiln package) beside it: STORE/images/<fp>")):
    """Build, verify and publish every spec's plan that is missing from the store.
    Exits 1 when any spec failed (the others are still built and reported)."""
    from kiln.builder.plan_ci.pipeline import CIOptions, rebuild
    from kiln.builder.plan_ci.report import render_markdown

    result = rebuild(_specs(specs), CIOptions(store=store, jobs=jobs, keep=keep, full=full,
                                              target=target, oci=oci))
    text = render_markdown(result)
    if report:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(text)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result.to_json(), indent=2, sort_keys=True))
    sys.stdout.write(text)
    if not result.ok:
        raise typer.Exit(1)


@app.command("rollback")
def rollback_cmd(name: str = typer.Argument(..., help="the spec name"),
                 to: Optional[str] = typer.Option(None, "--to", help="a fingerprint (or a "
                                                  "unique prefix); default: the previous plan"),
                 store: Path = STORE):
    """Point a spec back at an earlier plan in the store (a pointer move)."""
    from kiln.builder.plan_ci.store import PlanStore, StoreError

    s = PlanStore(store)
    old = s.current(name)
    try:
        ptr = s.rollback(name, to)
    except StoreError as e:
        _fail(str(e))
    typer.echo(f"{name}: {old[:12] if old else '(none)'} -> {ptr.fingerprint[:12]} "
               f"({s.plan_dir(ptr.fingerprint)})")


@app.command("current")
def current_cmd(name: Optional[str] = typer.Argument(None, help="a spec name (default: all)"),
                store: Path = STORE,
                digest: bool = typer.Option(False, "--digest", help="print the plan's digest "
                                            "(sha256 of its plan.json) instead of its directory: "
                                            "kiln serve --expect-digest"),
                oci_digest: bool = typer.Option(False, "--oci-digest", help="print the "
                                                "manifest digest of the OCI image kiln package "
                                                "made of the plan")):
    """Print the current plan directory of a spec (or of every spec): `kiln serve $(kiln ci
    current NAME)`. Fails when the plan is not the one the pointer recorded (its digest)."""
    from kiln.builder.plan_ci.store import PlanStore

    s = PlanStore(store)
    names = [name] if name else s.names()
    for n in names:
        ptr = s.pointer(n)
        if ptr is None:
            _fail(f"no current plan for {n!r} in {store}")
        now = s.digest(ptr.fingerprint)
        if now is None or (ptr.digest is not None and now != ptr.digest):
            _fail(f"the current plan of {n!r} ({s.plan_dir(ptr.fingerprint)}) is not the one "
                  f"made current: its plan.json sha256 is {now or '(missing)'}, the pointer "
                  f"recorded {ptr.digest}. Run kiln ci rebuild, or roll back")
        shown = now if digest else str(s.plan_dir(ptr.fingerprint))
        if oci_digest:
            shown = (s.package(ptr.fingerprint) or {}).get("manifest_digest")
            if not shown:
                _fail(f"the current plan of {n!r} has not been packaged: kiln package "
                      f"{s.plan_dir(ptr.fingerprint)} --oci DIR")
        typer.echo(shown if name else f"{n}\t{ptr.fingerprint[:12]}\t{shown}")
