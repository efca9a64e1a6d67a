"""The fast "is this plan up to date?" check, without importing torch.

The fingerprint needs the weights digest and the compile target, which cost seconds to
compute (hashing, importing torch). A plan therefore also records a *quick key*: a hash of
the resolved spec, the source files' paths, sizes and mtimes, the kiln and torch versions
(from package metadata), the digest of the plan-making code and this CPU's flags. When the quick key matches, nothing that
determines the fingerprint can have changed, so the plan is up to date; when it does not,
`kiln build` computes the real fingerprint (a touched but unchanged file still matches it).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from importlib import metadata
from importlib.machinery import PathFinder
from pathlib import Path

from kiln.builder.spec import Spec
from kiln.contracts import KILN_VERSION, MANIFEST_FILE, PLAN_FORMAT_VERSION
from kiln.contracts.manifest import PlanManifest

PKG_SCHEME = "pkg://"


def find_package_dir(package: str) -> Path | None:
    """The directory of an installed package, found on sys.path WITHOUT importing it."""
    locations = None
    for part in package.split("."):
        spec = PathFinder.find_spec(part, locations)
        if spec is None or not spec.submodule_search_locations:
            return None
        locations = list(spec.submodule_search_locations)
    return Path(locations[0])


def _source_files(source: str) -> list[Path] | None:
    if source == "random":
        return []
    if source.startswith(PKG_SCHEME):
        package, _, rel = source[len(PKG_SCHEME):].partition("/")
        root = find_package_dir(package)
        if root is None:
            return None
        source = str(root / rel)
    path = Path(os.path.expanduser(source))
    if path.is_file():
        return [path.resolve()]
    if path.is_dir():
        return sorted(p.resolve() for p in path.iterdir() if p.is_file())
    return None


def _cpu_flags_digest() -> str:
    from kiln.plugins.isa import cpu_flags

    return hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()


# The code that decides a plan's bytes: the builder, the plugins (their Python, and the C++
# compiled into the plan) and the plan contract. A change to any of it is a new toolchain,
# even without a version bump, so no cache serves a plan an older builder made.
PLAN_CODE = ("builder", "plugins", "contracts")
PLAN_CODE_SUFFIXES = (".py", ".cpp", ".h")


@functools.cache
def code_digest() -> str:
    """sha256 over the plan-making source files (paths relative to the folder that holds
    builder/, plugins/ and contracts/: the checkout, or the installed kiln package; contents);
    read once a process (a build asks for it in the quick key and in the fingerprint)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for top in PLAN_CODE:
        for f in sorted((root / top).rglob("*")):
            if f.suffix in PLAN_CODE_SUFFIXES and f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def quick_key(spec: Spec) -> str | None:
    """A cheap key that changes whenever any fingerprint input may have changed."""
    files = _source_files(spec.model.source)
    if files is None:
        return None
    if spec.model.tokenizer:
        tok = _source_files(spec.model.tokenizer)
        if tok is None:
            return None
        files += tok
    stats = []
    for f in files:
        st = f.stat()
        stats.append([str(f), st.st_size, st.st_mtime_ns])
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    data = {"spec": spec.canonical(), "files": stats, "kiln": KILN_VERSION,
            "code": code_digest(), "torch": torch_version, "cpu": _cpu_flags_digest(),
            "format": PLAN_FORMAT_VERSION}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def quick_up_to_date(spec: Spec, out: Path) -> PlanManifest | None:
    """The plan's manifest if the plan at `out` is up to date by its quick key, else None
    (also for a manifest of another format version, or one that does not read)."""
    try:
        manifest = PlanManifest.loads((out / MANIFEST_FILE).read_text())
    except (OSError, ValueError):   # ManifestError and JSONDecodeError are ValueErrors
        return None
    key = quick_key(spec)
    if key is None or manifest.quick_key != key:
        return None
    for rel, meta in manifest.files.items():
        f = out / rel
        if not f.is_file() or f.stat().st_size != meta.size:
            return None
    return manifest
