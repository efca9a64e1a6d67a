"""The `interpret` tier: the Triton kernels (GPU plugins) on CPU tensors under Triton's
interpreter, against the pure-torch references.

Triton decides at decoration time whether a kernel is compiled or interpreted, from
TRITON_INTERPRET. Without a CUDA device there is nothing to compile for, so this conftest
sets it before any test module here imports the kernels. Where CUDA exists the `gpu` tier
runs the compiled kernels, and this tier runs only when asked for with TRITON_INTERPRET=1
in the environment (setting it there would turn the gpu tier's kernels into interpreted
ones too: one process, one Triton mode).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    if INTERPRET:
        return
    skip = pytest.mark.skip(reason="CUDA is present: the gpu tier runs these kernels compiled "
                            "(run this tier with TRITON_INTERPRET=1 in its own process)")
    for item in items:
        if "interpret" in item.keywords:
            item.add_marker(skip)
