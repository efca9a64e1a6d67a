"""The plan fingerprint: a hash of everything that determines a plan.

Inputs: the canonical spec, a digest of the source weights, the kiln and torch versions and
a digest of the plan-making code, and the target (device, CPU arch and ISA, or compute capability). Same fingerprint = same
plan; any change = rebuild. `fingerprint_inputs` is returned alongside so a report can say
*which* input changed.
"""
from __future__ import annotations

import hashlib
import json
import platform
import sys

import torch

from kiln.builder.spec import Spec
from kiln.contracts import KILN_VERSION
from kiln.contracts.manifest import TargetSection


def toolchain() -> dict:
    from kiln.plugins.shims import ops_abi

    return {"kiln": KILN_VERSION, "torch": torch.__version__,
            "python": ".".join(map(str, sys.version_info[:3])), "ops": ops_abi()}


def build_target(spec: Spec) -> TargetSection:
    """The concrete target a plan is compiled for on this build machine (raises
    builder.target.TargetError when this machine cannot build it)."""
    if spec.target.is_gpu:
        return TargetSection(device=spec.target.device, arch=platform.machine(), isa="none",
                             isa_flags=(), cpu_features=(),
                             compute_capability=spec.target.compute_capability)
    from kiln.builder.target import cpu_target, resolve_level

    return cpu_target(resolve_level(spec.target.isa, spec.name))


def fingerprint_inputs(spec: Spec, weights_digest: str, target: TargetSection | None = None,
                       tools: dict | None = None, code: str | None = None) -> dict:
    from kiln.builder.uptodate import code_digest

    tools = tools or toolchain()
    target = target or build_target(spec)
    spec_data = spec.canonical()
    # Where a local checkpoint lives is not an input (its bytes are, via the weights digest):
    # moving a checkout or a model directory must not rebuild its plans.
    for key in ("source", "tokenizer"):
        value = spec_data["model"].get(key)
        if value and value != "random" and "://" not in value:
            spec_data["model"][key] = "local"
    return {
        "spec": hashlib.sha256(json.dumps(spec_data, sort_keys=True).encode()).hexdigest(),
        "weights": weights_digest,
        # python is not an input: neither the compiled engine nor the kernels embed it
        # code: the builder's, plugins' and contract's sources (builder/uptodate.code_digest):
        # an edited builder or kernel rebuilds plans even at the same version number
        "toolchain": {"kiln": tools["kiln"], "torch": tools["torch"],
                      "code": code or code_digest()},
        # every field of the target: device, arch, isa, isa_flags, cpu_features, compute_capability
        "target": target.to_json(),
    }


def fingerprint(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
