"""`pip install` creates exactly one top-level package, kiln, and the wheel carries every
module and kernel source of the checkout's package folders (pyproject.toml's package-dir),
and nothing else."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.unit.test_import_graph import PACKAGES, ROOT

pytestmark = pytest.mark.unit
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".proto", ".pyi"}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """The wheel's file names, built from a copy of the package folders (setuptools keeps a
    build/ folder between builds, whose stale files would end up in a wheel built in place)."""
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    for folder in PACKAGES.values():
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)],
                   check=True, capture_output=True, cwd=out)
    (whl,) = out.glob("kiln-*.whl")
    with zipfile.ZipFile(whl) as z:
        return set(z.namelist())


def source_files() -> set[str]:
    """The checkout's package sources, named as the wheel names them."""
    want = set()
    for pkg, folder in PACKAGES.items():
        base = ROOT / folder
        for f in base.rglob("*"):
            rel = f.relative_to(base)
            if f.is_file() and f.suffix in SOURCE_SUFFIXES and "__pycache__" not in rel.parts:
                want.add("/".join([*pkg.split("."), *rel.parts]))
    return want


def test_one_top_level_package(wheel_names):
    tops = {n.split("/")[0] for n in wheel_names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kiln"}


def test_the_wheel_holds_exactly_the_source_files(wheel_names):
    packaged = {n for n in wheel_names if not n.split("/")[0].endswith(".dist-info")}
    assert source_files() - packaged == set(), "missing from the wheel"
    assert packaged - source_files() == set(), "in the wheel but not in the checkout"
