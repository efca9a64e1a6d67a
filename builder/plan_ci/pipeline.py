"""`kiln ci rebuild`: every spec -> a current, verified plan in the store, and a report.

    assess every spec (quick keys first)                    -- in this process
    build + verify each one that needs it, in .staging/      -- here, or N worker processes
    publish the verified ones: plans/<fp>/, then the pointer -- here, one at a time
    prune old plans (--keep), report

A spec that fails (bad spec, unreadable checkpoint, failed build, failed verify) is reported
with its message and its current plan stays current; the others go on.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from kiln.builder.plan_ci.assess import BUILD, FAIL, REUSE, Assessment, assess
from kiln.builder.plan_ci.records import BuildOutcome, PlanRecord
from kiln.builder.plan_ci.report import FAILED, REBUILT, REUSED, RunReport, SpecResult
from kiln.builder.plan_ci.store import PlanStore, StoreError
from kiln.contracts.manifest import DraftRecord
from kiln.contracts.reports import VerifyReport


@dataclass(frozen=True)
class CIOptions:
    store: Path
    jobs: int = 1                  # builds at once (worker processes when > 1)
    keep: int = 3                  # plans kept per spec (the current one always stays)
    full: bool = False             # compute every fingerprint; ignore quick keys
    target: Optional[str] = None   # only specs with this target.device (CI runner per target)
    oci: bool = False              # publish each current plan's OCI image beside it too


def select(assessments: list[Assessment], target: Optional[str]) -> list[Assessment]:
    """The specs a job for `target` handles; a spec that does not load is every job's."""
    if target is None:
        return assessments
    return [a for a in assessments if a.device is None or a.device == target]


def assess_all(spec_paths: list[Path], opts: CIOptions) -> list[Assessment]:
    """Every spec's assessment, draft specs first: a spec whose draft_plan names a spec of
    this run is assessed against the draft's plan (the one in the store, or the one its build
    will publish); it fails when its draft spec fails or is not one of this run's."""
    store = PlanStore(opts.store)
    paths = order_drafts_first(spec_paths)
    done: dict[Path, Assessment] = {}
    for p in paths:
        drafter = _draft_spec(p)
        if drafter is None:
            done[p.resolve()] = assess(p, store, full=opts.full)
            continue
        d = done.get(drafter)
        if d is None or d.action == FAIL:
            a = _draft_failed(p, store, d, drafter)
        else:
            a = assess(p, store, full=opts.full, draft=DraftRecord(
                name=d.name, fingerprint=d.fingerprint, path=str(store.plan_dir(d.fingerprint))))
        done[p.resolve()] = a
    return select([done[p.resolve()] for p in paths], opts.target)


def _draft_failed(path: Path, store: PlanStore, d: Optional[Assessment],
                  drafter: Path) -> Assessment:
    """The failure of a spec whose draft spec failed or is not one of this run's."""
    from kiln.builder.draft import load_draft_spec
    from kiln.builder.spec import SpecError, load_spec

    try:
        spec = load_spec(path)
    except SpecError as e:
        return Assessment(path, FAIL, "invalid spec", error=str(e))
    why = (f"its draft spec {d.name or drafter} failed: {d.error or d.reason}" if d else
           f"its draft spec {drafter} is not one of this run's specs")
    try:
        load_draft_spec(spec, path)   # a draft spec naming a draft, a cycle: that message
    except SpecError as e:
        why = str(e)
    ptr = store.pointer(spec.name)
    return Assessment(path, FAIL, "draft spec failed", name=spec.name, device=spec.target.device,
                      previous=ptr.fingerprint if ptr else None, error=why, spec=spec)


def _draft_spec(path: Path) -> Optional[Path]:
    """The draft spec a spec file names (resolved), None when it names none or does not load."""
    from kiln.builder.draft import draft_spec_path
    from kiln.builder.spec import SpecError, load_spec

    try:
        return draft_spec_path(load_spec(path), path)
    except SpecError:
        return None


def order_drafts_first(spec_paths: list[Path]) -> list[Path]:
    """The specs with those another spec names as its draft first (a draft spec drafts
    alone, so one pass orders them); otherwise in the given order."""
    drafts = {d for p in spec_paths if (d := _draft_spec(p)) is not None}
    return sorted(spec_paths, key=lambda p: p.resolve() not in drafts)


def rebuild(spec_paths: list[Path], opts: CIOptions, log: Optional[TextIO] = None) -> RunReport:
    """Bring every spec's plan up to date in the store; never raises for one bad spec."""
    log = log or sys.stderr
    t0 = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    store = PlanStore(opts.store)
    results: dict[int, SpecResult] = {}
    jobs: list[tuple[int, Assessment, dict]] = []   # build_and_verify's keyword arguments
    for i, a in enumerate(assess_all(spec_paths, opts)):
        label = a.name or str(a.spec_path)
        if a.action == FAIL:
            results[i] = _result(a, FAILED, error=a.error)
            print(f"{label}: FAILED ({a.reason})", file=log)
        elif a.action == BUILD:
            print(f"{label}: building ({a.reason})", file=log)
            jobs.append((i, a, {"staging": str(store.staging_dir(a.name)),
                                "reference": _reference(store, a.previous)}))
        else:
            results[i] = _reuse(store, a, log)

    # two waves: draft specs are published before the specs that draft with them build
    for wave in ([j for j in jobs if j[1].draft is None], [j for j in jobs if j[1].draft]):
        for i, a, out in _run_jobs(_with_drafts(store, wave, results, log), opts.jobs):
            results[i] = _publish(store, a, out, opts.keep, log)
    if opts.oci:
        for res in results.values():
            _publish_image(store, res, log)
    return RunReport([results[i] for i in sorted(results)], str(opts.store),
                     time.perf_counter() - t0, started, _toolchain(), opts.target)


def _with_drafts(store: PlanStore, jobs: list, results: dict[int, SpecResult],
                 log: TextIO) -> list:
    """The jobs whose draft plan is in the store, each with it linked beside its staged plan
    (so the manifest records it as a sibling: plans/<fp>/../<draft fp>); the others fail,
    naming the draft."""
    ready = []
    for i, a, kw in jobs:
        if a.draft is None:
            ready.append((i, a, kw))
            continue
        fp = a.draft.fingerprint
        if not store.has(fp):
            failed = next((r for r in results.values() if r.name == a.draft.name), None)
            why = (f"its draft spec {a.draft.name} failed: {failed.error}" if failed
                   and failed.error else f"its draft plan {a.draft.name} {fp[:12]} is not in "
                   "the store")
            print(f"{a.name}: FAILED ({why.splitlines()[0]})", file=log)
            shutil.rmtree(kw["staging"], ignore_errors=True)
            results[i] = _result(a, FAILED, error=why)
            continue
        link = Path(kw["staging"]) / fp
        link.symlink_to(store.plan_dir(fp).resolve(), target_is_directory=True)
        ready.append((i, a, {**kw, "draft_plan": str(link)}))
    return ready


@dataclass(frozen=True)
class DryRun:
    """What `rebuild` would do (kiln ci plan): per spec, the targets that need a build (a CI
    matrix) and a cache key (changes whenever any spec's fingerprint does)."""
    specs: tuple[Assessment, ...]
    store: str

    def counts(self) -> dict[str, int]:
        return {k: sum(a.action == k for a in self.specs) for k in (REUSE, BUILD, FAIL)}

    @property
    def build_targets(self) -> list[str]:
        return sorted({a.device for a in self.specs if a.action == BUILD and a.device})

    @property
    def targets(self) -> list[str]:
        return sorted({a.device for a in self.specs if a.device})

    @property
    def cache_key(self) -> str:
        import hashlib
        import json

        key_data = sorted((a.name or str(a.spec_path), a.fingerprint or a.action)
                          for a in self.specs)
        return hashlib.sha256(json.dumps(key_data).encode()).hexdigest()[:32]

    def to_json(self) -> dict:
        """kiln ci plan --json."""
        return {"specs": [a.to_json() for a in self.specs], "store": self.store,
                "counts": self.counts(), "build_targets": self.build_targets,
                "targets": self.targets,
                "matrix": {"include": [{"target": t} for t in self.targets]},
                "cache_key": self.cache_key}


def dry_run(spec_paths: list[Path], opts: CIOptions) -> DryRun:
    """What `rebuild` would do, and why, for every spec; builds nothing."""
    return DryRun(tuple(assess_all(spec_paths, opts)), str(opts.store))


def _reference(store: PlanStore, fp: Optional[str]) -> Optional[dict[str, list[int]]]:
    """GoldenPrompt.key -> token ids of the current plan (for golden_agreement), if recorded."""
    rec = store.record(fp) if fp else None
    golden = rec.verify.golden if rec and rec.verify else ()
    return {g.key: list(g.token_ids) for g in golden if g.key and g.token_ids}


def _run_jobs(jobs, n: int):
    """Yield (index, assessment, build_and_verify output) as builds finish."""
    if n <= 1 or len(jobs) <= 1:
        for i, a, kw in jobs:
            yield i, a, build_and_verify(str(a.spec_path), **kw)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = multiprocessing.get_context("spawn")   # never fork a process that holds torch
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_worker_init,
                             initargs=(max(1, (os.cpu_count() or 1) // n),)) as pool:
        futures = {pool.submit(build_and_verify, str(a.spec_path), **kw): (i, a)
                   for i, a, kw in jobs}
        for f in as_completed(futures):
            i, a = futures[f]
            try:
                out = f.result()
            except Exception as e:   # the worker died
                out = BuildOutcome(False, None,
                                   error=f"build worker failed: {type(e).__name__}: {e}")
            yield i, a, out


def _worker_init(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def build_and_verify(spec_path: str, staging: str,
                     reference: Optional[dict[str, list[int]]],
                     draft_plan: Optional[str] = None) -> BuildOutcome:
    """Build the spec into staging/plan (against `draft_plan`, the stored plan of its draft
    spec) and verify it there (the outcome may cross a process boundary: pickled); never
    raises."""
    from kiln.builder.build import build
    from kiln.builder.progress import Progress

    try:
        res = build(spec_path, Path(staging) / "plan", force=True,
                    progress=Progress(enabled=False),
                    draft_plan=Path(draft_plan) if draft_plan else None)
    except Exception as e:
        return BuildOutcome(False, staging, error=_message(e))
    built = BuildOutcome(False, staging, fingerprint=res.fingerprint, build_seconds=res.seconds,
                         plan_bytes=res.manifest.total_bytes,
                         measured_accuracy=res.manifest.accuracy)
    t = time.perf_counter()
    try:
        from kiln.runtime.plan import load_plan
        from kiln.runtime.tools.verify import verify_plan

        report = verify_plan(load_plan(res.path), reference)
    except Exception as e:
        return dataclasses.replace(built, error=f"verify: {_message(e)}")
    return dataclasses.replace(
        built, ok=report.ok, verify_seconds=time.perf_counter() - t, verify_text=report.text,
        verify=report, error=None if report.ok else "verification failed:\n" + report.text)


def _message(e: BaseException) -> str:
    from kiln.builder.spec import SpecError

    known = (SpecError,)
    try:
        from kiln.builder.build import BuildError
        from kiln.builder.sources import CheckpointError
        from kiln.runtime.plan import PlanError

        known += (BuildError, CheckpointError, PlanError)
    except Exception:
        pass
    if isinstance(e, known):
        return str(e)
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def _publish(store: PlanStore, a: Assessment, out: BuildOutcome, keep: int,
             log: TextIO) -> SpecResult:
    staging = Path(out.staging) if out.staging else None
    try:
        if not out.ok:
            print(f"{a.name}: FAILED; current plan unchanged"
                  f"{f' ({a.previous[:12]})' if a.previous else ''}", file=log)
            return _result(a, FAILED, out, error=out.error)
        fp = out.fingerprint
        if out.verify_text:   # name the plan where it will be, not where it was built
            out = dataclasses.replace(out, verify_text=out.verify_text.replace(
                str(staging / "plan"), str(store.plan_dir(fp))))
        try:   # the plan, the pointer (from where assess found it) and prune: one update
            ptr, removed = store.publish(staging / "plan", fp, PlanRecord(
                name=a.name, spec_path=str(a.spec_path), reason=a.reason,
                changed=tuple(a.changed), previous=a.previous, build_seconds=out.build_seconds,
                verify=out.verify, verify_text=out.verify_text), a.previous, keep)
        except (StoreError, OSError) as e:
            print(f"{a.name}: FAILED to publish {fp[:12]}: {e}", file=log)
            return _result(a, FAILED, out, error=f"publishing {fp[:12]}: {e}")
        print(f"{a.name}: published {fp[:12]} (plan.json sha256 {ptr.digest})"
              + (f", pruned {len(removed)} old plan(s)" if removed else ""), file=log)
        res = _result(a, REBUILT, out)
        res.fingerprint = fp
        return res
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _publish_image(store: PlanStore, res: SpecResult, log: TextIO) -> None:
    """The current plan of a spec that did not fail, as an OCI image beside it in the store
    (images/<fp>/, its digest in packages/<fp>.json); a failure fails the spec."""
    if not res.ok or not res.fingerprint:
        return
    fp = res.fingerprint
    try:
        digest, written = store.publish_image(fp)
    except Exception as e:     # PackageError, StoreError, OSError: reported with the spec
        print(f"{res.name}: FAILED to package {fp[:12]}: {e}", file=log)
        res.status, res.error = FAILED, f"packaging {fp[:12]}: {e}"
        return
    print(f"{res.name}: {'packaged' if written else 'image already in the store for'} "
          f"{fp[:12]}: {digest}", file=log)


def _result(a: Assessment, status: str, out: Optional[BuildOutcome] = None,
            error: Optional[str] = None) -> SpecResult:
    out = out or BuildOutcome(False, None)
    verify = out.verify
    return SpecResult(
        spec_path=str(a.spec_path), status=status, reason=a.reason, name=a.name,
        device=a.device, fingerprint=None if status == FAILED else a.fingerprint,
        previous=a.previous, changed=a.changed, build_seconds=out.build_seconds,
        verify_seconds=out.verify_seconds, plan_bytes=out.plan_bytes,
        accuracy=_accuracy_summary(verify), verify=_verify_line(verify) if verify else None,
        verify_text=out.verify_text, error=error)


def _accuracy_summary(verify: Optional[VerifyReport]) -> Optional[str]:
    return verify.accuracy.summary if verify and verify.accuracy else None


def _verify_line(report: VerifyReport) -> str:
    good = sum(g.ok for g in report.golden)
    parts = [f"golden {good}/{len(report.golden)}"]
    agreement = report.agreement
    if agreement is not None and agreement.value is not None:
        parts.append(f"agreement {agreement.value:.2f} (min {agreement.minimum:.2f})")
    return ("ok: " if report.parts_ok else "FAILED: ") + ", ".join(parts)


def _reuse(store: PlanStore, a: Assessment, log: TextIO) -> SpecResult:
    """Point the spec at the plan it reuses (from where assess found the pointer)."""
    label = a.name or str(a.spec_path)
    try:
        if store.current(a.name) != a.fingerprint:
            store.set_current(a.name, a.fingerprint, expected=a.previous)
    except StoreError as e:
        print(f"{label}: FAILED to reuse {a.fingerprint[:12]}: {e}", file=log)
        return _result(a, FAILED, error=f"reusing {a.fingerprint[:12]}: {e}")
    print(f"{label}: reused {a.fingerprint[:12]} ({a.reason})", file=log)
    return _reused(store, a)


def _reused(store: PlanStore, a: Assessment) -> SpecResult:
    res = _result(a, REUSED)
    m = store.manifest(a.fingerprint)
    res.plan_bytes = (sum(size or 0 for size in m.file_sizes.values()) or None) if m else None
    rec = store.record(a.fingerprint)
    res.accuracy = _accuracy_summary(rec.verify) if rec else None
    res.verify = "verified when published" if rec else None
    if a.previous == a.fingerprint:
        res.previous = None       # nothing moved
    return res


def _toolchain() -> dict:
    """kiln and torch versions without importing torch (package metadata)."""
    from importlib import metadata

    from kiln.contracts import KILN_VERSION

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"kiln": KILN_VERSION, "torch": torch_version}
