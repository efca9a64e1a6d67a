"""The plan store: plans by fingerprint, one pointer per spec.

    store/
      plans/<fingerprint>/        a plan directory exactly as `kiln build` wrote it; never
                                  changed once there (content-addressed)
      records/<fingerprint>.json  what kiln ci learnt building it: verify details (the golden
                                  outputs the next plan is compared with), build time, why
      current/<name>.json         {"fingerprint": ..., "digest": sha256 of its plan.json,
                                   "history": [older fingerprints],
                                   "pinned_from": the spec's own plan after a rollback}
      .staging/                   builds in progress (same filesystem, so publishing is a rename)
      .lock                       held (flock) by every update of the store

Publishing is two atomic steps: rename the verified plan into plans/<fp>/, then replace the
pointer file, each made durable (files and directories fsynced) before the next. A reader sees
the old plan or the new one, never half of one; a rollback is a pointer move. A rollback pins
the pointer: kiln ci keeps it there while the spec's inputs still give the plan it was rolled
back from, and moves on once they change. The pointer records the digest of the plan it names
(kiln.contracts.manifest.manifest_digest), so what is current is pinned by content too:
`kiln ci current NAME --digest` -> `kiln serve --expect-digest`.

Concurrent runs: every update (publish, pointer move, rollback, prune) holds the store's lock,
so prune always sees the pointer as it is and never removes the current plan, nor one a
rollback is making current. A run moves a pointer only from where it found it (`expected`,
compare-and-swap): a pointer another run or a rollback moved meanwhile is left there
(PointerMoved). Reading takes no lock.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kiln.builder.plan_ci.records import PlanRecord
from kiln.contracts import MANIFEST_FILE as MANIFEST
from kiln.contracts.manifest import StoredPlan, manifest_digest


class StoreError(RuntimeError):
    """A store operation that cannot be done (the message says why)."""


class PointerMoved(StoreError):
    """A pointer is no longer where the caller found it (another run or a rollback moved it)."""


_ANY = object()   # set_current's expected: move the pointer from wherever it is


def write_json_atomic(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Make every file under `root`, and the directories holding them, durable."""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(d))


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Pointer:
    name: str
    fingerprint: str
    history: tuple[str, ...]        # previously current fingerprints, newest first
    updated_at: str
    pinned_from: Optional[str] = None   # set by a rollback: the plan it rolled back from
    digest: Optional[str] = None        # sha256 of the plan's plan.json when it was set


class PlanStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.plans = self.root / "plans"
        self.records = self.root / "records"
        self.current_dir = self.root / "current"
        self.staging = self.root / ".staging"
        self._held = threading.local()      # this thread's depth in lock()

    @contextlib.contextmanager
    def lock(self):
        """Hold the store's lock (re-entrant within a thread); every update takes it."""
        if getattr(self._held, "depth", 0):
            self._held.depth += 1
            try:
                yield
            finally:
                self._held.depth -= 1
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._held.depth = 1
            try:
                yield
            finally:
                self._held.depth = 0
        finally:
            os.close(fd)     # releases the lock

    # ---- reading --------------------------------------------------------------------------------
    def plan_dir(self, fp: str) -> Path:
        return self.plans / fp

    def manifest(self, fp: str) -> Optional[StoredPlan]:
        """What every format version of a stored plan's plan.json records (plans outlive the
        kiln that built them: kiln.contracts.manifest.StoredPlan)."""
        return StoredPlan.from_json(_read_json(self.plan_dir(fp) / MANIFEST))

    def has(self, fp: str) -> bool:
        """A complete plan under this fingerprint: manifest agrees, every file at its size."""
        d = self.plan_dir(fp)
        m = self.manifest(fp)
        if m is None or m.fingerprint != fp:
            return False
        try:         # a plan pruned while this reads (no lock) is not there
            return all((d / rel).is_file() and (d / rel).stat().st_size == size
                       for rel, size in m.file_sizes.items())
        except OSError:
            return False

    def digest(self, fp: str) -> Optional[str]:
        """The stored plan's digest: sha256 of its plan.json (None: no plan.json)."""
        try:
            return manifest_digest((self.plan_dir(fp) / MANIFEST).read_bytes())
        except OSError:
            return None

    def record(self, fp: str) -> Optional[PlanRecord]:
        """What kiln ci recorded when it published plan fp (None: no record)."""
        return PlanRecord.from_json(_read_json(self.records / f"{fp}.json"))

    def package(self, fp: str) -> Optional[dict]:
        """The OCI image `kiln package` made of plan fp: {"manifest_digest", "layer_digest",
        "plan_digest"} (None: not packaged)."""
        return _read_json(self.root / "packages" / f"{fp}.json")

    def record_package(self, fp: str, manifest_digest: str, layer_digest: str,
                       plan_digest: str) -> None:
        """Record, beside plan fp's content address, the OCI image digest it packages to."""
        with self.lock():
            write_json_atomic(self.root / "packages" / f"{fp}.json",
                              {"manifest_digest": manifest_digest, "layer_digest": layer_digest,
                               "plan_digest": plan_digest})

    def image_dir(self, fp: str) -> Path:
        """Where `kiln ci rebuild --oci` publishes plan fp's OCI image layout."""
        return self.root / "images" / fp

    def publish_image(self, fp: str) -> tuple[str, bool]:
        """Package plan fp as an OCI image layout at image_dir(fp), beside the plan, and
        record its digest (record_package) -> (manifest digest, whether it was written now).
        A plan already packaged there is left as it is. Written in staging and renamed into
        place, so a reader never sees half an image."""
        from kiln.runtime.tools.package import PackageError, package_plan, read_layout

        record, dest = self.package(fp), self.image_dir(fp)
        if record and dest.is_dir():
            try:      # every blob checked: a damaged image is written again
                if read_layout(dest).manifest.digest == record.get("manifest_digest"):
                    return record["manifest_digest"], False
            except PackageError:
                pass
        self.staging.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=self.staging, prefix=f"image-{fp[:12]}-"))
        try:
            done = package_plan(self.plan_dir(fp), work / "oci")
            with self.lock():
                if not self.has(fp):
                    raise StoreError(f"plan {fp[:12]} left the store while it was packaged")
                dest.parent.mkdir(parents=True, exist_ok=True)
                if dest.exists():
                    self._remove(dest)
                os.replace(work / "oci", dest)
                self.record_package(fp, done.manifest.digest, done.layer.digest,
                                    done.plan_digest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return done.manifest.digest, True

    def pointer(self, name: str) -> Optional[Pointer]:
        data = _read_json(self.current_dir / f"{name}.json")
        if not data or not isinstance(data.get("fingerprint"), str):
            return None
        return Pointer(name, data["fingerprint"], tuple(data.get("history") or ()),
                       data.get("updated_at", ""), data.get("pinned_from"), data.get("digest"))

    def current(self, name: str) -> Optional[str]:
        p = self.pointer(name)
        return p.fingerprint if p else None

    def names(self) -> list[str]:
        if not self.current_dir.is_dir():
            return []
        return sorted(p.stem for p in self.current_dir.glob("*.json"))

    def plans_of(self, name: str) -> list[tuple[str, StoredPlan]]:
        """(fingerprint, manifest) of every plan of this spec name, newest first."""
        found = []
        if self.plans.is_dir():
            for d in self.plans.iterdir():
                m = StoredPlan.from_json(_read_json(d / MANIFEST))
                if m and m.name == name:
                    found.append((d.name, m))
        def published(item) -> tuple:
            rec = self.record(item[0])
            return (item[1].created_at, rec.published_at if rec else 0.0)
        return sorted(found, key=published, reverse=True)

    # ---- writing --------------------------------------------------------------------------------
    def staging_dir(self, name: str) -> Path:
        """A fresh directory for a build of `name`, on the store's filesystem."""
        self.staging.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=self.staging, prefix=f"{name}-"))

    def add_plan(self, plan_dir: Path, fp: str, record: PlanRecord) -> Path:
        """Move a verified plan into plans/<fp>/ (its record first). Returns its path."""
        fsync_tree(plan_dir)           # its bytes are on disk before its name is published
        with self.lock():
            write_json_atomic(self.records / f"{fp}.json",
                              dataclasses.replace(record, published_at=time.time()).to_json())
            dst = self.plan_dir(fp)
            self.plans.mkdir(parents=True, exist_ok=True)
            if self.has(fp):           # same fingerprint = same plan: keep the one there
                shutil.rmtree(plan_dir, ignore_errors=True)
                return dst
            if dst.exists():           # an incomplete leftover under that name
                self._remove(dst)
            os.replace(plan_dir, dst)
            fsync_dir(self.plans)
            return dst

    def set_current(self, name: str, fp: str, pinned_from: Optional[str] = None,
                    expected=_ANY) -> Pointer:
        """Point `name` at plan `fp` (atomic); the previous one goes into the history.
        expected: the fingerprint the caller found current (None: no pointer); PointerMoved
        when the pointer is elsewhere now and not already at `fp`."""
        with self.lock():
            old = self.pointer(name)
            now = old.fingerprint if old else None
            if expected is not _ANY and now != expected:
                if now == fp:          # another run made the same move
                    return old
                raise PointerMoved(
                    f"{name!r} now points at {now[:12] if now else '(none)'}, not at "
                    f"{expected[:12] if expected else '(none)'} as when this run assessed it "
                    "(another kiln ci run or a rollback moved it meanwhile); it stays there")
            if not self.has(fp):
                raise StoreError(f"no complete plan {fp} in {self.plans}")
            history = []
            if old is not None:
                history = [h for h in (old.fingerprint, *old.history) if h != fp]
            ptr = Pointer(name, fp, tuple(history),
                          time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          pinned_from if pinned_from != fp else None, self.digest(fp))
            self._write_pointer(ptr)
            return ptr

    def publish(self, plan_dir: Path, fp: str, record: PlanRecord, expected: Optional[str],
                keep: int) -> tuple[Pointer, list[str]]:
        """One kiln ci publish, all under the lock: add the plan, move `record.name`'s pointer
        to it from `expected` (PointerMoved, the plan staying in the store, when another run
        or a rollback moved it since), prune to `keep` -> (the pointer, fingerprints removed)."""
        with self.lock():
            self.add_plan(plan_dir, fp, record)
            ptr = self.set_current(record.name, fp, expected=expected)
            return ptr, self.prune(record.name, keep)

    def _write_pointer(self, ptr: Pointer) -> None:
        write_json_atomic(self.current_dir / f"{ptr.name}.json",
                          {"name": ptr.name, "fingerprint": ptr.fingerprint,
                           "history": list(ptr.history), "updated_at": ptr.updated_at,
                           "pinned_from": ptr.pinned_from, "digest": ptr.digest})

    def rollback(self, name: str, to: Optional[str] = None) -> Pointer:
        """Point `name` back at `to` (a fingerprint or a unique prefix of one), or at the plan
        that was current before this one. Pinned until the spec's inputs change."""
        with self.lock():
            old = self.pointer(name)
            if old is None:
                raise StoreError(f"no current plan for {name!r} in {self.current_dir}")
            if to is None:
                choices = [h for h in old.history if self.has(h)]
                if not choices:
                    raise StoreError(f"{name!r} has no earlier plan in the store to roll back to")
                target = choices[0]
            else:
                matches = [fp for fp, _ in self.plans_of(name) if fp.startswith(to)]
                if len(matches) != 1:
                    have = ", ".join(fp[:16] for fp, _ in self.plans_of(name)) or "none"
                    raise StoreError(f"{to!r} matches {len(matches)} plans of {name!r} "
                                     f"(plans of {name!r} in the store: {have})")
                target = matches[0]
            return self.set_current(name, target, pinned_from=old.pinned_from or old.fingerprint)

    def prune(self, name: str, keep: int) -> list[str]:
        """Remove all but the `keep` newest plans of `name`; the current one always stays
        (and, after a rollback, the plan it rolled back from), and so does one that a stored
        plan drafts with (speculative method draft: it cannot serve without it)."""
        with self.lock():         # the pointer cannot move while this decides and removes
            ptr = self.pointer(name)
            plans = [fp for fp, _ in self.plans_of(name)]
            kept = set(plans[:max(keep, 0)]) | self.drafts_in_use()
            if ptr is not None:   # the current plan, and the one a rollback came from
                kept |= {ptr.fingerprint, ptr.pinned_from}
            removed = [fp for fp in plans if fp not in kept]
            for fp in removed:
                self._remove(self.plan_dir(fp))
                (self.records / f"{fp}.json").unlink(missing_ok=True)
                (self.root / "packages" / f"{fp}.json").unlink(missing_ok=True)
                if self.image_dir(fp).exists():
                    self._remove(self.image_dir(fp))
            if removed and ptr is not None:
                self._write_pointer(dataclasses.replace(
                    ptr, history=tuple(h for h in ptr.history if h not in removed)))
            return removed

    def drafts_in_use(self) -> set[str]:
        """Fingerprints of the draft plans the stored plans record (speculative.draft)."""
        used = set()
        if self.plans.is_dir():
            for d in self.plans.iterdir():
                spec = (_read_json(d / MANIFEST) or {}).get("speculative")
                draft = spec.get("draft") if isinstance(spec, dict) else None
                if isinstance(draft, dict) and isinstance(draft.get("fingerprint"), str):
                    used.add(draft["fingerprint"])
        return used

    def _remove(self, plan_dir: Path) -> None:
        """Remove a plan directory; renamed away first, so a reader never sees a half-deleted
        plan under its fingerprint."""
        self.staging.mkdir(parents=True, exist_ok=True)
        trash = Path(tempfile.mkdtemp(dir=self.staging, prefix=f"prune-{plan_dir.name}-"))
        try:
            os.replace(plan_dir, trash / "plan")
        except FileNotFoundError:     # removed by hand meanwhile: nothing to do
            pass
        shutil.rmtree(trash, ignore_errors=True)
