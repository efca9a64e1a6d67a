"""`pip install` creates exactly one top-level package, kiln, and the wheel carries every
module and kernel source of the checkout's package folders (pyproject.toml's package-dir)."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.unit.test_import_graph import PACKAGES, ROOT

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, cwd=out)
    (whl,) = out.glob("kiln-*.whl")
    with zipfile.ZipFile(whl) as z:
        return set(z.namelist())


def test_one_top_level_package(wheel_names):
    tops = {n.split("/")[0] for n in wheel_names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kiln"}


def test_every_source_file_is_in_the_wheel(wheel_names):
    want = set()
    for pkg, folder in PACKAGES.items():
        base = ROOT / folder
        for f in base.rglob("*"):
            rel = f.relative_to(base)
            if f.is_file() and f.suffix in {".py", ".cpp", ".h", ".proto", ".pyi"} \
                    and "__pycache__" not in rel.parts:
                want.add("/".join([*pkg.split("."), *rel.parts]))
    assert want - wheel_names == set()
