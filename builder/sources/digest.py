"""sha256 of source files, cached by (path, size, mtime) so a rebuild check is cheap.

The cache is a JSON file in $XDG_CACHE_HOME/kiln (default ~/.cache/kiln); a cache that
cannot be read or written is ignored (the digest is then just computed).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln" / "digests.json"


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: Path, key: str, entry: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load(path)          # re-read: another process may have added entries
        data[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".digests.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex of a file's bytes, from the cache when path, size and mtime are unchanged."""
    p = Path(path).resolve()
    st = p.stat()
    key = str(p)
    cache = _cache_path()
    hit = _load(cache).get(key)
    if isinstance(hit, dict) and hit.get("size") == st.st_size \
            and hit.get("mtime_ns") == st.st_mtime_ns and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    _store(cache, key, {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest})
    return digest


def files_sha256(root: str | os.PathLike, names: list[str]) -> str:
    """One digest for several files of a directory: sha256 of their `sha256sum` lines, sorted."""
    lines = sorted(f"{file_sha256(Path(root) / n)}  {n}\n" for n in names)
    return hashlib.sha256("".join(lines).encode()).hexdigest()
