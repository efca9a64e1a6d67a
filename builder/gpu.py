"""The CUDA side of `kiln build`: what a GPU plan needs from the build machine, and the
pieces of the build that differ from a CPU plan.

AOTInductor generates code for the GPU it runs on, so a GPU plan is built on the GPU its
spec names (as TensorRT-LLM builds engines): the build machine must have CUDA, a GPU of the
spec's compute capability, a CUDA build of torch and Triton (AOTInductor compiles the
plugins' Triton kernels, plugins/paged_kv/triton_attention.py and
plugins/quant/triton_linear.py, into the package). What a capability cannot run at all
(Kiln's kernels below sm_80, FP8 below sm_89) is refused earlier, by the spec
(builder/spec.py).

    check_build_machine(spec) -> gpu_facts   refuses with need / have / what to do
    target(spec, facts)                      plan.json's `target` for a GPU plan
    prepare_model(model, spec)               the eager model on the GPU, in the activations'
                                             dtype (what torch.export captures)
    activation_dtype(spec)                   that dtype
    engine_plugins(spec)                     the plugins whose ops a GPU engine calls
"""
from __future__ import annotations

import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Optional

from kiln.builder.spec import FP8_MIN_SM, Spec

ACTIVATION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class GpuBuildError(RuntimeError):
    """This machine cannot build the GPU plan a spec asks for; the message says why."""


@dataclass(frozen=True)
class GpuFacts:
    """The build machine's GPU, as recorded in the plan (`target`)."""
    compute_capability: str   # sm_90
    device_name: str          # NVIDIA H200
    cuda: str                 # torch's CUDA runtime version, 13.0
    driver: Optional[str]     # the NVIDIA driver (nvidia-smi), when it can be read
    triton: str               # the Triton that compiled the kernels


def _torch_cuda():
    import torch

    return torch


def check_build_machine(spec: Spec) -> GpuFacts:
    """The facts of this machine's GPU when it can build `spec`'s GPU plan; GpuBuildError,
    saying what the plan needs, what this machine has and what to do, when it cannot."""
    torch = _torch_cuda()
    want = spec.target.compute_capability
    where = f"Build this spec on a {spec.target.device} machine, or set target.device: cpu."
    if torch.version.cuda is None:
        raise GpuBuildError(
            f"target.device {spec.target.device!r} ({want}) needs a CUDA build of torch on a "
            f"machine with that GPU; this torch ({torch.__version__}) is a CPU-only build and "
            f"this machine cannot compile for CUDA. {where}")
    if not torch.cuda.is_available():
        raise GpuBuildError(
            f"target.device {spec.target.device!r} ({want}) is compiled on a machine with that "
            "GPU (AOTInductor generates code for the device it runs on); this machine has no "
            f"usable CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}). {where}")
    major, minor = torch.cuda.get_device_capability()
    have = f"sm_{major}{minor}"
    name = torch.cuda.get_device_name()
    if have != want:
        raise GpuBuildError(
            f"target.device {spec.target.device!r} needs compute capability {want}; this "
            f"machine's GPU is {have} ({name}). {where}")
    try:
        import triton
    except ImportError:
        raise GpuBuildError(
            "a GPU plan compiles Kiln's Triton kernels into its engine; this machine has no "
            "`triton` package (pip install triton, the version your torch build names)") from None
    return GpuFacts(have, name, str(torch.version.cuda), driver_version(), triton.__version__)


def driver_version() -> Optional[str]:
    """The NVIDIA driver version (nvidia-smi), or None where it cannot be read."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else None


def target(spec: Spec, facts: GpuFacts) -> dict:
    """plan.json's `target` for a GPU plan (the fingerprint reads device, arch, isa and
    compute_capability from it; `cuda` and `triton` belong there too: both shape the code)."""
    return {"device": spec.target.device, "arch": platform.machine(), "isa": "none",
            "isa_flags": [], "cpu_features": [], **asdict(facts)}


def activation_dtype(spec: Spec):
    """The torch dtype a GPU engine computes in: precision.activations as written (fp32 runs,
    at fp32 speed; GPU specs normally say bf16). fp8 activations are a matmul input format,
    not a model dtype: the model runs bf16 around the fp8 linears."""
    import torch

    name = "bf16" if spec.precision.activations == "fp8" else spec.precision.activations
    return getattr(torch, ACTIVATION_DTYPES[name])


def prepare_model(model, spec: Spec):
    """The eager model for export on the GPU: on cuda, in the activations' dtype."""
    return cast_to_activations(model.to("cuda"), activation_dtype(spec))


def cast_to_activations(model, dt):
    """Float32 parameters cast to `dt`, in place. Buffers keep their dtypes: packed weights,
    the quant plugin's float32 scales, zero points, biases and input scales (its kernels
    read them so), and RoPE's inverse frequencies (positions times a bf16 frequency would
    be off by whole radians at long contexts)."""
    import torch

    for p in model.parameters():
        if p.dtype == torch.float32:
            p.data = p.data.to(dt)
    return model


def engine_plugins(spec: Spec) -> list[str]:
    """The plugins whose ops a GPU engine calls: their Triton kernels are compiled into the
    engine, so the runtime needs them only for the eager backend."""
    return ["paged_kv"] + (["quant"] if spec.precision.weights in ("int8", "int4", "fp8")
                           else [])


def fp8_supported(compute_capability: str) -> bool:
    return int(compute_capability[3:]) >= FP8_MIN_SM
