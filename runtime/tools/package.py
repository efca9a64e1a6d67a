"""A plan as an OCI image: `kiln package PLAN --oci DIR` and its verified unpacking.

    DIR/oci-layout                  {"imageLayoutVersion": "1.0.0"}
    DIR/index.json                  one manifest, ref name = the plan's name
    DIR/blobs/sha256/<manifest>     image manifest: the config + one layer
    DIR/blobs/sha256/<config>       image config: rootfs.diff_ids = [the layer's digest]
    DIR/blobs/sha256/<layer>        uncompressed tar: models/<plan-name>/plan.json and every
                                    file plan.json lists (and models/<draft-name>/ likewise for
                                    a plan that serves with a draft plan)

Deterministic: entries sorted, mtime 0, uid/gid 0, no user names, modes 0644/0755, the layer
uncompressed (no gzip header to vary) and every JSON document written with sorted keys and no
date. The same plan gives the same manifest digest on any machine and from any directory it
was copied to: nothing of the host or of the plan's path goes in. Each plan file is checked
against the sha256 plan.json records while it is written, so a damaged plan is never packaged.

Unpacking checks the layout against the OCI image-layout rules it relies on (oci-layout
version, media types), then the size and sha256 of the manifest, config and every layer blob
before one byte is extracted; extraction takes regular files and directories under
models/<name>/ (and the draft's models/<draft>/) only (no links, no absolute or `..`
paths). The unpacked plan is then loaded like any plan (runtime/plan.py load_plan: format,
target, toolchain, checksums).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

from kiln.contracts import MANIFEST_FILE
from kiln.contracts.manifest import ManifestError, PlanManifest, manifest_digest
from kiln.runtime.tools import modelcar as mc
from kiln.runtime.tools.oci_tar import (LAYER_MEDIA, Descriptor, HashingWriter, PackageError,
                                        tar_entry)

LAYOUT_VERSION = "1.0.0"
INDEX_MEDIA = "application/vnd.oci.image.index.v1+json"
MANIFEST_MEDIA = "application/vnd.oci.image.manifest.v1+json"
CONFIG_MEDIA = "application/vnd.oci.image.config.v1+json"
MODELS_ROOT = "models"
REF_ANNOTATION = "org.opencontainers.image.ref.name"
# platform.machine() of the plan's target -> the OCI (GOARCH) architecture name
OCI_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64",
            "ppc64le": "ppc64le", "s390x": "s390x"}


@dataclass(frozen=True)
class Packaged:
    """What `package_plan` wrote."""

    layout: Path
    name: str                # the plan's name: the ref name and models/<name>
    manifest: Descriptor     # its digest names the image (`oci://...@sha256:...`)
    layer: Descriptor
    plan_digest: str         # sha256 of plan.json (kiln serve --expect-digest)
    fingerprint: str
    shell: Optional[Descriptor] = None   # the modelcar's busybox layer, below the plan's


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _read_plan_manifest(plan: Path) -> tuple[PlanManifest, bytes]:
    try:
        raw = (plan / MANIFEST_FILE).read_bytes()
    except OSError as e:
        raise PackageError(f"{plan} is not a plan: cannot read {MANIFEST_FILE} ({e.strerror}). "
                           "Build one with: kiln build model_specs/<spec>.yaml") from None
    try:
        return PlanManifest.loads(raw.decode()), raw
    except (ManifestError, ValueError) as e:
        raise PackageError(f"{plan / MANIFEST_FILE} is not a valid plan manifest ({e}); "
                           "rebuild the plan") from None


class _CheckedReader(io.RawIOBase):
    """Reads a plan file while hashing it; `check()` compares with plan.json's sha256."""

    def __init__(self, f, rel: str, sha256: str):
        self.f, self.rel, self.want, self.sha = f, rel, sha256, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.sha.update(memoryview(b)[:n])
        return n

    def check(self, plan: Path) -> None:
        if self.sha.hexdigest() != self.want:
            raise PackageError(f"plan {plan}: {self.rel} does not match the sha256 plan.json "
                               "records; the plan is damaged, rebuild it before packaging")


def _write_layer(trees: list[tuple[Path, PlanManifest, bytes]], out) -> Descriptor:
    """The layer tar of the plans `trees` (directory, manifest, plan.json bytes; each under
    models/<its name>/) into the open file `out`; its descriptor."""
    entries: list[tuple[PurePosixPath, Path, PlanManifest, bytes, str]] = []
    dirs: set[PurePosixPath] = set()
    for plan, manifest, raw in trees:
        root = PurePosixPath(MODELS_ROOT, manifest.name)
        dirs.update((root.parent, root))
        for rel in sorted({MANIFEST_FILE, *manifest.files}):
            p = PurePosixPath(rel)
            if p.is_absolute() or ".." in p.parts:
                raise PackageError(f"plan {plan}: file {rel!r} is outside the plan directory")
            dirs.update((root / p).parents)
            entries.append((root / p, plan, manifest, raw, rel))
    dirs.discard(PurePosixPath("."))
    writer = HashingWriter(out)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            tar.addfile(tar_entry(f"{d}/", 0o755, is_dir=True))
        for name, plan, manifest, raw, rel in sorted(entries, key=lambda e: e[0]):
            if rel == MANIFEST_FILE:
                tar.addfile(tar_entry(str(name), 0o644, len(raw)), io.BytesIO(raw))
                continue
            entry = manifest.files[rel]
            path = plan / rel
            if not path.is_file() or path.stat().st_size != entry.size:
                raise PackageError(f"plan {plan}: {rel} is missing or not {entry.size} bytes; "
                                   "rebuild the plan before packaging")
            with open(path, "rb") as f:
                reader = _CheckedReader(f, rel, entry.sha256)
                tar.addfile(tar_entry(str(name), 0o644, entry.size),
                            io.BufferedReader(reader, 1 << 22))
                reader.check(plan)
    return Descriptor(LAYER_MEDIA, "sha256:" + writer.sha.hexdigest(), writer.size)


def _draft_tree(plan: Path, manifest: PlanManifest) -> Optional[tuple[Path, PlanManifest, bytes]]:
    """The draft plan a method-draft plan serves with, to travel in the same layer: it must be
    the plan's sibling directory of the draft's own name (the image puts both under models/,
    where the recorded relative path finds it) and have the recorded fingerprint."""
    spec = manifest.speculative
    if spec is None or spec.draft is None:
        return None
    rec = spec.draft
    fix = (f"rebuild {manifest.name} against its draft, with the draft built into "
           f"../{rec.name} beside it")
    if PurePosixPath(rec.path) != PurePosixPath("..", rec.name):
        raise PackageError(f"plan {plan} drafts with {rec.path!r}, not a sibling directory "
                           f"named after the draft plan ({rec.name!r}); an image holds plans "
                           f"side by side under /{MODELS_ROOT}: {fix}")
    draft, raw = _read_plan_manifest(plan / rec.path)
    if draft.name != rec.name or draft.fingerprint != rec.fingerprint:
        raise PackageError(f"plan {plan}'s draft {plan / rec.path} is {draft.name} "
                           f"{draft.fingerprint}, the plan was built against {rec.name} "
                           f"{rec.fingerprint}: {fix}")
    return plan / rec.path, draft, raw


def _put_blob(blobs: Path, data: bytes, media_type: str) -> Descriptor:
    hexd = hashlib.sha256(data).hexdigest()
    (blobs / hexd).write_bytes(data)
    return Descriptor(media_type, "sha256:" + hexd, len(data))


def package_plan(plan: str | Path, out: str | Path, modelcar: bool = False,
                 busybox_deb: Optional[Path] = None) -> Packaged:
    """Write plan directory `plan` as an OCI image layout at `out` (a new or empty directory).
    `modelcar`: a layer with Debian's static busybox below the plan's (runtime/tools/modelcar.py),
    from `busybox_deb` or apt's archive cache, so KServe can run the image as a modelcar."""
    plan, out = Path(plan), Path(out)
    manifest, raw = _read_plan_manifest(plan)
    arch = OCI_ARCH.get(manifest.target.arch, manifest.target.arch)
    shell_deb = None
    if modelcar:
        shell_deb = mc.read_deb(mc.find_deb(busybox_deb), arch)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PackageError(f"{out} exists and is not an empty directory; give a new one")
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    try:
        shell = None if shell_deb is None else _put_layer(
            blobs, lambda f: mc.write_shell_layer(shell_deb, f))
        trees = [(plan, manifest, raw)] + [t for t in (_draft_tree(plan, manifest),) if t]
        layer = _put_layer(blobs, lambda f: _write_layer(trees, f))
    except BaseException:
        shutil.rmtree(out / "blobs", ignore_errors=True)   # nothing half-written stays
        raise
    layers = [d for d in (shell, layer) if d is not None]
    plan_digest = manifest_digest(raw)
    labels = {"dev.kiln.plan.name": manifest.name, "dev.kiln.plan.digest": plan_digest,
              "dev.kiln.plan.fingerprint": manifest.fingerprint,
              "dev.kiln.plan.path": f"/{MODELS_ROOT}/{manifest.name}"}
    image_config: dict = {"Labels": labels}
    if shell_deb is not None:
        labels["dev.kiln.modelcar.shell"] = f"{mc.PACKAGE} {shell_deb.version}"
        image_config["Env"] = [mc.PATH_ENV]
    config = _put_blob(blobs, _canonical({
        "architecture": arch, "os": "linux", "config": image_config,
        "rootfs": {"type": "layers", "diff_ids": [d.digest for d in layers]}}), CONFIG_MEDIA)
    image = _put_blob(blobs, _canonical({
        "schemaVersion": 2, "mediaType": MANIFEST_MEDIA, "config": config.to_json(),
        "layers": [d.to_json() for d in layers],
        "annotations": {"org.opencontainers.image.title": manifest.name, **labels}}),
        MANIFEST_MEDIA)
    (out / "oci-layout").write_bytes(_canonical({"imageLayoutVersion": LAYOUT_VERSION}))
    (out / "index.json").write_bytes(_canonical({
        "schemaVersion": 2, "mediaType": INDEX_MEDIA,
        "manifests": [{**image.to_json(), "annotations": {REF_ANNOTATION: manifest.name},
                       "platform": {"architecture": arch, "os": "linux"}}]}))
    return Packaged(out, manifest.name, image, layer, plan_digest, manifest.fingerprint, shell)


def _put_layer(blobs: Path, write) -> Descriptor:
    """A layer written by write(file) -> Descriptor, stored under its digest."""
    with open(blobs / ".layer", "wb") as f:
        desc = write(f)
    os.replace(blobs / ".layer", blobs / desc.digest.removeprefix("sha256:"))
    return desc


# ---- reading a layout back ------------------------------------------------------------------

def _load_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise PackageError(f"{what} {path} is missing ({e.strerror})") from None
    except ValueError as e:
        raise PackageError(f"{what} {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise PackageError(f"{what} {path} is not a JSON object")
    return data


def _descriptor(d: object, media_type: str, what: str) -> Descriptor:
    if not isinstance(d, dict):
        raise PackageError(f"{what}: not a descriptor object")
    digest, size = d.get("digest"), d.get("size")
    if d.get("mediaType") != media_type:
        raise PackageError(f"{what}: media type {d.get('mediaType')!r}, expected {media_type}")
    if (not isinstance(digest, str) or not digest.startswith("sha256:")
            or len(digest) != 71 or not all(c in "0123456789abcdef" for c in digest[7:])):
        raise PackageError(f"{what}: digest {digest!r} is not sha256:<64 hex>")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise PackageError(f"{what}: size {size!r} is not a byte count")
    return Descriptor(media_type, digest, size)


def verify_blob(layout: Path, desc: Descriptor, what: str) -> Path:
    """The blob file of `desc`, after checking its size and sha256 (PackageError if not)."""
    path = layout / "blobs" / "sha256" / desc.digest.removeprefix("sha256:")
    if not path.is_file():
        raise PackageError(f"{layout}: the {what} blob {desc.digest} is missing")
    if path.stat().st_size != desc.size:
        raise PackageError(f"{layout}: the {what} blob {desc.digest} is "
                           f"{path.stat().st_size} bytes, its descriptor says {desc.size}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    if "sha256:" + h.hexdigest() != desc.digest:
        raise PackageError(f"{layout}: the {what} blob {desc.digest} has been altered "
                           f"(its content hashes to sha256:{h.hexdigest()})")
    return path


@dataclass(frozen=True)
class Layout:
    """A verified OCI layout of a plan: every blob checked against its digest."""

    path: Path
    name: str
    manifest: Descriptor
    layers: tuple[Path, ...]


def read_layout(layout: str | Path) -> Layout:
    """Check an OCI layout written by `package_plan`: oci-layout, index.json, media types,
    and the size and sha256 of the manifest, config and every layer."""
    layout = Path(layout)
    marker = _load_json(layout / "oci-layout", "OCI layout marker")
    if marker.get("imageLayoutVersion") != LAYOUT_VERSION:
        raise PackageError(f"{layout}/oci-layout: imageLayoutVersion "
                           f"{marker.get('imageLayoutVersion')!r}, expected {LAYOUT_VERSION}")
    index = _load_json(layout / "index.json", "OCI index")
    if index.get("schemaVersion") != 2:
        raise PackageError(f"{layout}/index.json: schemaVersion {index.get('schemaVersion')!r}, "
                           "expected 2")
    entries = index.get("manifests")
    if not isinstance(entries, list) or len(entries) != 1:
        raise PackageError(f"{layout}/index.json: expected exactly one manifest (a plan image)")
    desc = _descriptor(entries[0], MANIFEST_MEDIA, "index.json manifests[0]")
    name = (entries[0].get("annotations") or {}).get(REF_ANNOTATION)
    image = json.loads(verify_blob(layout, desc, "manifest").read_bytes())
    config = _descriptor(image.get("config"), CONFIG_MEDIA, "manifest config")
    config_doc = json.loads(verify_blob(layout, config, "config").read_bytes())
    layers = image.get("layers")
    if not isinstance(layers, list) or not layers:
        raise PackageError(f"{layout}: the image manifest lists no layers")
    layer_descs = [_descriptor(d, LAYER_MEDIA, f"manifest layers[{i}]")
                   for i, d in enumerate(layers)]
    diff_ids = (config_doc.get("rootfs") or {}).get("diff_ids")
    if diff_ids != [d.digest for d in layer_descs]:
        raise PackageError(f"{layout}: the config's rootfs.diff_ids do not name the manifest's "
                           "layers")
    paths = tuple(verify_blob(layout, d, f"layer {i}") for i, d in enumerate(layer_descs))
    if not isinstance(name, str) or not name:
        raise PackageError(f"{layout}/index.json: the manifest has no {REF_ANNOTATION}")
    return Layout(layout, name, desc, paths)


def _extract(layer: Path, roots: dict[PurePosixPath, Path]) -> None:
    """Regular files and directories of `layer` under each root, into its directory; anything
    else (a link, a device, a path outside every root) refuses the layer."""
    with tarfile.open(layer, mode="r:") as tar:
        for info in tar:
            p = PurePosixPath(info.name.rstrip("/"))
            if p.is_absolute() or ".." in p.parts:
                raise PackageError(f"{layer}: entry {info.name!r} leaves the image root")
            if (p == PurePosixPath(MODELS_ROOT) or p in roots) and info.isdir():
                continue
            root = next((r for r in roots if r in p.parents), None)
            if root is None or not (info.isfile() or info.isdir()):
                raise PackageError(f"{layer}: entry {info.name!r} is not a file or directory "
                                   f"under /{' or /'.join(map(str, roots))}")
            target = roots[root] / p.relative_to(root)
            if info.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)


def _packed_draft(layer: Path, root: PurePosixPath) -> Optional[str]:
    """The name of the draft plan that the layer's plan (under `root`) records, if any."""
    with tarfile.open(layer, mode="r:") as tar:
        for info in tar:
            if PurePosixPath(info.name) == root / MANIFEST_FILE and info.isfile():
                with tar.extractfile(info) as f:
                    raw = f.read()
                try:
                    spec = PlanManifest.loads(raw.decode()).speculative
                except (ManifestError, ValueError) as e:
                    raise PackageError(f"{layer}: /{root}/{MANIFEST_FILE} is not a valid plan "
                                       f"manifest ({e})") from None
                return None if spec is None or spec.draft is None else spec.draft.name
    raise PackageError(f"{layer}: the layer holds no /{root}/{MANIFEST_FILE}")


def _check_outside(layer: Path, models: PurePosixPath) -> None:
    """A layer below the plan's must hold nothing under /models (the plan is all there is)."""
    with tarfile.open(layer, mode="r:") as tar:
        for info in tar:
            p = PurePosixPath(info.name.rstrip("/"))
            if p == models or models in p.parents or p.is_absolute() or ".." in p.parts:
                raise PackageError(f"{layer}: entry {info.name!r} of a layer below the plan's "
                                   f"is under /{models} or leaves the image root")


def unpack_layout(layout: str | Path, dest: str | Path) -> Path:
    """Verify an OCI plan layout (read_layout), unpack its plan into `dest` (new or empty),
    and return the plan directory; load it with runtime/plan.py load_plan to verify it.
    An image of a plan that serves with a draft plan holds both: they are unpacked side by
    side as dest/<plan> and dest/<draft> (where the plan's relative record finds the draft),
    and dest/<plan> is returned."""
    found = read_layout(layout)
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise PackageError(f"{dest} exists and is not an empty directory; give a new one")
    dest.mkdir(parents=True, exist_ok=True)
    root = PurePosixPath(MODELS_ROOT, found.name)
    try:
        for layer in found.layers[:-1]:     # a modelcar's shell: the plan is the top layer
            _check_outside(layer, PurePosixPath(MODELS_ROOT))
        draft = _packed_draft(found.layers[-1], root)
        roots = {root: dest} if draft is None else {
            root: dest / found.name, PurePosixPath(MODELS_ROOT, draft): dest / draft}
        _extract(found.layers[-1], roots)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return roots[root]


def load_packaged(layout: str | Path, dest: str | Path, expect_digest: Optional[str] = None):
    """Unpack a verified OCI plan layout into `dest` and load the plan like any plan
    (runtime/plan.py load_plan: format, target, toolchain, checksums)."""
    from kiln.runtime.plan import load_plan

    return load_plan(unpack_layout(layout, dest), expect_digest=expect_digest)
