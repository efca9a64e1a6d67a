"""The shell layer of a modelcar plan image (`kiln package --modelcar`).

KServe runs an `oci://` model image as a sidecar whose command is a shell line (it links the
image's /models where the server container reads it, then sleeps), so the image needs `sh`,
`ln` and `sleep`. They come from Debian's busybox-static: its package file's /bin/busybox,
taken out with dpkg-deb, in a layer of its own below the plan's:

    bin/busybox                     0755, the static binary as Debian ships it
    bin/{cat,echo,ln,ls,sh,sleep}   links to busybox (its applets)
    usr/share/doc/busybox-static/copyright

Deterministic like the plan layer (sorted, mtime 0, uid/gid 0, no user names): the same
.deb gives the same layer digest on any machine. The package's name, architecture and
version are checked before anything is written.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

from kiln.runtime.tools.oci_tar import (LAYER_MEDIA, Descriptor, HashingWriter, PackageError,
                                        tar_entry)

PACKAGE = "busybox-static"
BUSYBOX = "./bin/busybox"
COPYRIGHT = f"./usr/share/doc/{PACKAGE}/copyright"
APPLETS = ("cat", "echo", "ln", "ls", "sh", "sleep")
APT_ARCHIVES = Path("/var/cache/apt/archives")   # where apt-get --download-only leaves it
PATH_ENV = "PATH=/bin"


@dataclass(frozen=True)
class ShellDeb:
    """Debian's busybox-static package file, checked, and the two files the layer takes."""
    path: Path
    version: str
    busybox: bytes
    copyright: bytes


def deb_dirs() -> tuple[Path, ...]:
    """Where a busybox-static .deb is looked for: kiln's cache (scripts/setup.sh puts it
    there with `apt-get download`), then apt's archive cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln" / "debs", APT_ARCHIVES


def find_deb(given: Optional[Path] = None) -> Path:
    """The busybox-static .deb to use: `given`, else the newest one in deb_dirs()."""
    if given is not None:
        return Path(given)
    for d in deb_dirs():
        found = sorted(d.glob(f"{PACKAGE}_*.deb"))
        if found:
            return found[-1]
    raise PackageError(f"--modelcar needs Debian's {PACKAGE} package file and none is in "
                       f"{' or '.join(map(str, deb_dirs()))}: run `apt-get download {PACKAGE}` "
                       "and give it with --busybox-deb FILE")


def _dpkg_deb(*args: str) -> bytes:
    exe = shutil.which("dpkg-deb")
    if exe is None:
        raise PackageError("--modelcar needs dpkg-deb (Debian's dpkg) to read the "
                           f"{PACKAGE} package file")
    r = subprocess.run([exe, *args], capture_output=True, timeout=120)
    if r.returncode != 0:
        raise PackageError(f"dpkg-deb {' '.join(args)} failed: "
                           f"{r.stderr.decode(errors='replace').strip()}")
    return r.stdout


def read_deb(deb: Path, arch: str) -> ShellDeb:
    """Check that `deb` is busybox-static for OCI architecture `arch`; its busybox binary and
    copyright file. PackageError naming the problem otherwise."""
    if not deb.is_file():
        raise PackageError(f"--busybox-deb {deb}: no such file")
    fields = _dpkg_deb("--field", str(deb), "Package", "Architecture", "Version")
    info = dict(line.split(": ", 1) for line in fields.decode().splitlines() if ": " in line)
    if info.get("Package") != PACKAGE:
        raise PackageError(f"{deb} is the package {info.get('Package')!r}, not {PACKAGE} "
                           "(a static busybox is needed: the image has no libc)")
    if info.get("Architecture") != arch:
        raise PackageError(f"{deb} is for {info.get('Architecture')}, the plan's target is "
                           f"{arch}")
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(_dpkg_deb("--fsys-tarfile", str(deb))),
                      mode="r:") as tar:
        for member in tar:
            if member.name in (BUSYBOX, COPYRIGHT) and member.isfile():
                files[member.name] = tar.extractfile(member).read()
    missing = [m for m in (BUSYBOX, COPYRIGHT) if m not in files]
    if missing:
        raise PackageError(f"{deb} has no {', '.join(missing)}")
    return ShellDeb(deb, info.get("Version", ""), files[BUSYBOX], files[COPYRIGHT])


def write_shell_layer(shell: ShellDeb, out):
    """The shell layer's tar into the open file `out` -> its Descriptor."""
    entries: dict[str, tuple[tarfile.TarInfo, Optional[bytes]]] = {}
    files = {BUSYBOX[2:]: (shell.busybox, 0o755), COPYRIGHT[2:]: (shell.copyright, 0o644)}
    for name, (data, mode) in files.items():
        entries[name] = (tar_entry(name, mode, len(data)), data)
        for parent in PurePosixPath(name).parents:
            if str(parent) != ".":
                entries[f"{parent}/"] = (tar_entry(f"{parent}/", 0o755, is_dir=True), None)
    for applet in APPLETS:
        link = tar_entry(f"bin/{applet}", 0o777)
        link.type, link.linkname = tarfile.SYMTYPE, "busybox"
        entries[f"bin/{applet}"] = (link, None)
    writer = HashingWriter(out)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(entries, key=lambda n: n.rstrip("/")):
            info, data = entries[name]
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return Descriptor(LAYER_MEDIA, "sha256:" + writer.sha.hexdigest(), writer.size)
