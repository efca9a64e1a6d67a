"""The checked-in kiln.v1 code is what scripts/gen_protos.sh makes from kiln.proto."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server_helpers import ROOT

pytestmark = pytest.mark.unit
PROTO_DIR = ROOT / "runtime" / "server" / "proto"


def test_generated_code_is_in_sync(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True,
                   env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    fresh = tmp_path / "runtime" / "server" / "proto"
    made = sorted(p.name for p in fresh.iterdir())
    assert made == ["kiln_pb2.py", "kiln_pb2.pyi", "kiln_pb2_grpc.py"]
    for name in made:
        assert (fresh / name).read_text() == (PROTO_DIR / name).read_text(), (
            f"runtime/server/proto/{name} is stale: run scripts/gen_protos.sh")
