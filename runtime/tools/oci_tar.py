"""The pieces of an OCI image layer both layer writers share (runtime/tools/package.py for
the plan, runtime/tools/modelcar.py for the shell): descriptors, deterministic tar headers, a
hashing writer, and the error either refuses with."""
from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import dataclass

LAYER_MEDIA = "application/vnd.oci.image.layer.v1.tar"


class PackageError(RuntimeError):
    """A plan that cannot be packaged, or an OCI layout that is refused (message for a person)."""


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a blob is, its sha256 and size."""

    media_type: str
    digest: str    # "sha256:<hex>"
    size: int

    def to_json(self) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


def tar_entry(name: str, mode: int, size: int = 0, is_dir: bool = False) -> tarfile.TarInfo:
    """A tar header with nothing of the host in it: mtime 0, uid/gid 0, no user names."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode, info.size, info.mtime = mode, size, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what goes through it into `out`."""

    def __init__(self, out):
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.out.write(b)
        self.sha.update(b)
        self.size += len(b)
        return len(b)
