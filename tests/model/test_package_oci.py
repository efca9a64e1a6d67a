"""`kiln package PLAN --oci DIR`: a deterministic OCI image layout of a plan, refused at
unpacking when a blob is missing or altered, and recorded beside the plan in a kiln ci store."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kiln.runtime.plan import load_plan
from kiln.runtime.tools.package import (CONFIG_MEDIA, INDEX_MEDIA, LAYER_MEDIA, MANIFEST_MEDIA,
                                        PackageError, load_packaged, package_plan, read_layout)

pytestmark = pytest.mark.model


def _blob(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def test_same_plan_same_digest_twice_and_from_a_copy(tiny_plan, tmp_path):
    a = package_plan(tiny_plan, tmp_path / "a")
    b = package_plan(tiny_plan, tmp_path / "b")
    copy = shutil.copytree(tiny_plan, tmp_path / "elsewhere" / "renamed")
    c = package_plan(copy, tmp_path / "c")
    assert a.manifest == b.manifest == c.manifest
    for rel in ("index.json", "oci-layout"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "c" / rel).read_bytes()
    assert a.plan_digest == load_plan(tiny_plan).digest


def test_layout_follows_the_image_layout_spec(tiny_plan, tmp_path):
    """What the OCI image-layout and image-manifest specs require of the files written."""
    out = package_plan(tiny_plan, tmp_path / "oci")
    root = tmp_path / "oci"
    assert json.loads((root / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((root / "index.json").read_text())
    assert index["schemaVersion"] == 2 and index["mediaType"] == INDEX_MEDIA
    [entry] = index["manifests"]
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == out.name
    for blob in (root / "blobs" / "sha256").iterdir():    # every blob is named by its sha256
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    image = json.loads(_blob(root, entry["digest"]).read_bytes())
    assert entry["mediaType"] == image["mediaType"] == MANIFEST_MEDIA
    assert image["schemaVersion"] == 2 and image["config"]["mediaType"] == CONFIG_MEDIA
    config = json.loads(_blob(root, image["config"]["digest"]).read_bytes())
    assert config["os"] == "linux" and config["architecture"] == "amd64"
    [layer] = image["layers"]
    assert layer["mediaType"] == LAYER_MEDIA
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer["digest"]]}
    with tarfile.open(_blob(root, layer["digest"])) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names[:2] == ["models", f"models/{out.name}"]
    files = sorted(m.name for m in members if m.isfile())
    assert f"models/{out.name}/plan.json" in files and len(files) == len(set(files))
    assert all(m.mtime == 0 and m.uid == m.gid == 0 and not m.uname for m in members)
    manifest = json.loads((tiny_plan / "plan.json").read_text())
    assert files == sorted(f"models/{out.name}/{rel}" for rel in [*manifest["files"],
                                                                   "plan.json"])


def test_unpacked_plan_loads_and_is_byte_identical(tiny_plan, tmp_path):
    out = package_plan(tiny_plan, tmp_path / "oci")
    plan = load_packaged(tmp_path / "oci", tmp_path / "unpacked", expect_digest=out.plan_digest)
    for rel in [*plan.manifest.files, "plan.json"]:
        assert (plan.path / rel).read_bytes() == (tiny_plan / rel).read_bytes()


def _layer_path(layout: Path) -> Path:
    found = read_layout(layout)
    return found.layers[0]


def test_tampered_layer_is_refused_before_unpacking(tiny_plan, tmp_path):
    package_plan(tiny_plan, tmp_path / "oci")
    layer = _layer_path(tmp_path / "oci")
    data = bytearray(layer.read_bytes())
    data[-20000] ^= 1          # inside the last file's bytes; the size is unchanged
    layer.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="has been altered"):
        load_packaged(tmp_path / "oci", tmp_path / "unpacked")
    assert not (tmp_path / "unpacked").exists() or not any((tmp_path / "unpacked").iterdir())


def test_missing_layer_is_refused(tiny_plan, tmp_path):
    package_plan(tiny_plan, tmp_path / "oci")
    _layer_path(tmp_path / "oci").unlink()
    with pytest.raises(PackageError, match="layer 0 blob sha256:[0-9a-f]{64} is missing"):
        load_packaged(tmp_path / "oci", tmp_path / "unpacked")


def test_a_damaged_plan_is_not_packaged(tiny_plan, tmp_path):
    """Each file is checked against plan.json's sha256 as it goes into the layer."""
    plan = shutil.copytree(tiny_plan, tmp_path / "plan")
    gen = plan / "generation.json"
    gen.write_bytes(gen.read_bytes().replace(b"{", b"{ ", 1))
    with pytest.raises(PackageError, match="generation.json"):
        package_plan(plan, tmp_path / "refused")   # the packager checks each file too
    assert not (tmp_path / "refused" / "index.json").exists()


def test_cli_records_the_digest_in_the_ci_store(tiny_plan, tmp_path):
    fp = load_plan(tiny_plan).fingerprint
    store = tmp_path / "store"
    (store / "current").mkdir(parents=True)
    stored = shutil.copytree(tiny_plan, store / "plans" / fp)
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "package", str(stored), "--oci",
                        str(tmp_path / "oci")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    record = json.loads((store / "packages" / f"{fp}.json").read_text())
    digest = read_layout(tmp_path / "oci").manifest.digest
    assert record["manifest_digest"] == digest and digest in r.stdout
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "unpack", str(tmp_path / "oci"),
                        "--out", str(tmp_path / "u"), "--expect-digest", "0" * 64],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "error:" in r.stderr and "Traceback" not in r.stderr



@pytest.mark.skipif(not (shutil.which("skopeo") and shutil.which("umoci")),
                    reason="Debian's skopeo and umoci are not installed (scripts/setup.sh "
                           "installs them when run as root)")
def test_skopeo_reads_and_umoci_unpacks_the_layout(tiny_plan, tmp_path):
    """Two independent OCI implementations accept the layout: skopeo reports the digest
    kiln printed, umoci unpacks byte-identical files under /models/NAME."""
    out = package_plan(tiny_plan, tmp_path / "oci")
    ref = f"{tmp_path / 'oci'}:{out.name}"
    info = json.loads(subprocess.run(["skopeo", "inspect", f"oci:{ref}"], check=True,
                                     capture_output=True, text=True, timeout=60).stdout)
    assert info["Digest"] == out.manifest.digest
    assert info["Layers"] == [out.layer.digest]
    subprocess.run(["umoci", "unpack", "--rootless", "--image", ref, str(tmp_path / "bundle")],
                   check=True, capture_output=True, timeout=60)
    unpacked = tmp_path / "bundle" / "rootfs" / "models" / out.name
    manifest = json.loads((tiny_plan / "plan.json").read_text())
    for rel in [*manifest["files"], "plan.json"]:
        assert (unpacked / rel).read_bytes() == (tiny_plan / rel).read_bytes(), rel


def _busybox_deb() -> Path:
    from kiln.runtime.tools.modelcar import find_deb
    if not shutil.which("dpkg-deb"):
        pytest.skip("dpkg-deb is not installed (a Debian host)")
    try:
        return find_deb()
    except PackageError as e:
        pytest.skip(f"{e} (scripts/setup.sh downloads it)")


def test_modelcar_image_has_a_deterministic_busybox_layer_below_the_plan(tiny_plan, tmp_path):
    """--modelcar: Debian's static busybox (sh, ln, sleep: what KServe's modelcar sidecar
    runs) in a layer of its own, the same digest twice; the plan layer and the unpacked plan
    are those of the plain image; a package that is not busybox-static is refused."""
    deb = _busybox_deb()
    a = package_plan(tiny_plan, tmp_path / "a", modelcar=True, busybox_deb=deb)
    b = package_plan(shutil.copytree(tiny_plan, tmp_path / "copy"), tmp_path / "b",
                     modelcar=True, busybox_deb=deb)
    plain = package_plan(tiny_plan, tmp_path / "plain")
    assert a.manifest == b.manifest and a.shell == b.shell and a.shell is not None
    assert a.layer == plain.layer and a.manifest != plain.manifest
    found = read_layout(tmp_path / "a")
    assert [p.name for p in found.layers] == [d.digest[7:] for d in (a.shell, a.layer)]
    with tarfile.open(found.layers[0]) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin/sh"].issym() and members["bin/sh"].linkname == "busybox"
    assert members["bin/busybox"].mode == 0o755
    assert all(m.mtime == 0 and m.uid == m.gid == 0 and not m.uname for m in members.values())
    assert not any(n.startswith("models") for n in members)
    plan = load_packaged(tmp_path / "a", tmp_path / "unpacked", expect_digest=a.plan_digest)
    for rel in [*plan.manifest.files, "plan.json"]:
        assert (plan.path / rel).read_bytes() == (tiny_plan / rel).read_bytes(), rel
    not_busybox = tmp_path / "not.deb"
    not_busybox.write_bytes(b"!<arch>\nnot a package\n")
    with pytest.raises(PackageError, match="dpkg-deb"):
        package_plan(tiny_plan, tmp_path / "refused", modelcar=True, busybox_deb=not_busybox)
    assert not (tmp_path / "refused").exists()


@pytest.mark.skipif(not (shutil.which("skopeo") and shutil.which("umoci")),
                    reason="Debian's skopeo and umoci are not installed")
def test_skopeo_and_umoci_read_the_modelcar_image_and_its_shell_runs(tiny_plan, tmp_path):
    """skopeo reports both layers and PATH=/bin; umoci unpacks a rootfs whose busybox runs
    the modelcar's shell line (link the plan directory elsewhere, list it through the link,
    sleep)."""
    deb = _busybox_deb()
    out = package_plan(tiny_plan, tmp_path / "oci", modelcar=True, busybox_deb=deb)
    ref = f"{tmp_path / 'oci'}:{out.name}"
    info = json.loads(subprocess.run(["skopeo", "inspect", f"oci:{ref}"], check=True,
                                     capture_output=True, text=True, timeout=60).stdout)
    assert info["Digest"] == out.manifest.digest
    assert info["Layers"] == [out.shell.digest, out.layer.digest]
    assert info["Env"] == ["PATH=/bin"]
    subprocess.run(["umoci", "unpack", "--rootless", "--image", ref, str(tmp_path / "bundle")],
                   check=True, capture_output=True, timeout=60)
    rootfs = tmp_path / "bundle" / "rootfs"
    (tmp_path / "mnt").mkdir()
    r = subprocess.run([str(rootfs / "bin" / "sh"), "-c",
                        'ln -s "$0/models" "$1/" && ls "$1/models" && sleep 0',
                        str(rootfs), str(tmp_path / "mnt")],
                       env={"PATH": str(rootfs / "bin")}, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and r.stdout.split() == [out.name], r.stderr
    plan_json = rootfs / "models" / out.name / "plan.json"
    assert plan_json.read_bytes() == (tiny_plan / "plan.json").read_bytes()
