"""The GPU build path up to the point that needs CUDA: what the spec refuses per compute
capability, and what a machine without the spec's GPU says (this tier runs without CUDA)."""
import pytest
import torch

from kiln.builder import gpu
from kiln.builder.spec import parse_spec
from tests.helpers import TINY_SPEC as BASE, spec_problems as problems

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("device", ["a100", "a10g", "sm_86", "sm_80"])
def test_fp8_weights_below_sm89_are_refused(device):
    probs, msg = problems(BASE + f"target: {{device: {device}}}\nprecision: {{weights: fp8}}\n")
    assert set(probs) == {"precision.weights"}
    assert "sm_89" in probs["precision.weights"] and device in probs["precision.weights"]
    assert "int8" in probs["precision.weights"]      # says what to use instead


def test_fp8_kv_cache_below_sm89_is_refused():
    probs, _ = problems(BASE + "target: {device: a100}\n"
                        "precision: {weights: bf16, kv_cache: fp8}\n")
    assert set(probs) == {"precision.kv_cache"} and "sm_89" in probs["precision.kv_cache"]


@pytest.mark.parametrize("device", ["l40s", "h100", "h200", "sm_89", "sm_90", "b200"])
def test_fp8_on_fp8_gpus_is_accepted(device):
    spec = parse_spec(BASE + f"target: {{device: {device}}}\n"
                      "precision: {weights: fp8, kv_cache: fp8, activations: bf16}\n")
    assert gpu.fp8_supported(spec.target.compute_capability)


@pytest.mark.parametrize("device", ["sm_75", "sm_70"])
def test_gpus_below_sm80_are_refused(device):
    probs, _ = problems(BASE + f"target: {{device: {device}}}\nprecision: {{weights: bf16}}\n")
    assert "sm_80" in probs["target.device"]


def test_fp16_kv_cache_is_a_gpu_only_pool():
    spec = parse_spec(BASE + "target: {device: h100}\nprecision: {weights: bf16, kv_cache: fp16}\n")
    assert spec.kv_dtype == "fp16"
    probs, _ = problems(BASE + "precision: {weights: bf16, kv_cache: fp16}\n")
    assert "precision.kv_cache" in probs


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_target_on_a_cpu_machine_is_refused_by_the_gpu_check():
    spec = parse_spec(BASE + "target: {device: h200}\nprecision: {weights: bf16}\n")
    with pytest.raises(gpu.GpuBuildError) as e:
        gpu.check_build_machine(spec)
    msg = str(e.value)
    assert "'h200'" in msg and "sm_90" in msg                 # what the plan needs
    assert torch.__version__ in msg                           # what this machine has
    assert "target.device: cpu" in msg                        # what to do


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_kiln_build_of_a_gpu_spec_on_a_cpu_machine_fails_before_any_work(tmp_path):
    """The builder refuses before it opens the checkpoint or writes anything."""
    from kiln.builder.build import BuildError, build
    from kiln.builder.progress import Progress

    spec = tmp_path / "gpu.yaml"
    spec.write_text(BASE + "target: {device: h100}\nprecision: {weights: bf16}\n")
    out = tmp_path / "plan"
    with pytest.raises(BuildError, match="h100"):
        build(spec, out, progress=Progress(enabled=False))
    assert not out.exists() and list(tmp_path.iterdir()) == [spec]


def test_gpu_plan_target_records_the_gpu():
    spec = parse_spec(BASE + "target: {device: h200}\nprecision: {weights: bf16}\n")
    facts = gpu.GpuFacts("sm_90", "NVIDIA H200", "13.0", "580.65", "3.9.0")
    t = gpu.target(spec, facts)
    assert t["device"] == "h200" and t["compute_capability"] == "sm_90"
    assert (t["cuda"], t["driver"], t["triton"], t["isa"]) == ("13.0", "580.65", "3.9.0", "none")


@pytest.mark.parametrize("activations,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                               ("fp32", torch.float32), ("fp8", torch.bfloat16)])
def test_activation_dtype_is_the_spec_s(activations, dtype):
    spec = parse_spec(BASE + f"target: {{device: h100}}\nprecision: {{weights: fp8, "
                      f"activations: {activations}}}\n")
    assert gpu.activation_dtype(spec) == dtype


def test_cast_to_activations_keeps_packed_weights_and_float32_scales():
    from kiln.plugins.quant.modules import QuantLinear
    from tests.runtime_helpers import tiny_model

    model = tiny_model()
    lin = model.layers[0].attention.wqkv
    model.layers[0].attention.wqkv = QuantLinear.from_linear(lin, "int8")
    gpu.cast_to_activations(model, torch.bfloat16)
    q = model.layers[0].attention.wqkv
    assert q.qweight.dtype == torch.int8 and q.scales.dtype == torch.float32
    assert model.layers[0].attention.wo.weight.dtype == torch.bfloat16
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32          # RoPE frequencies stay float32


def test_a_model_cast_for_bf16_activations_runs_and_stays_close():
    """What prepare_model hands torch.export on a GPU, run eagerly here: float32 logits
    within bf16's error of the float32 model's."""
    from kiln.plugins.paged_kv import kv_format
    from kiln.runtime.executor import ModelInput
    from tests.runtime_helpers import tiny_model

    inp = ModelInput.build([[1, 5, 9, 11, 3], [7]], [0, 0], [[0], [1]], 16)
    logits = []
    for dt, kv in ((None, "fp32"), (torch.bfloat16, "bf16")):
        model = tiny_model() if dt is None else gpu.cast_to_activations(tiny_model(), dt)
        cfg = model.cfg
        pools = kv_format.new_pools(kv, cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim)
        with torch.no_grad():
            logits.append(model(*inp.args(), *pools))
    assert logits[1].dtype == torch.float32
    scale = logits[0].abs().max()
    assert (logits[0] - logits[1]).abs().max() <= 0.02 * scale
