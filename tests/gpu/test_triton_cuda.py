"""On a CUDA device: the Triton kernels, compiled, against the pure-torch references on the
same device, and AOTInductor compiling them into a package that writes the pools in place.

Imports of the Triton modules stay inside the tests: Triton fixes a kernel's mode (compiled or
interpreted) when the module is imported, and this module must not import them where the
`interpret` tier runs (tests/interpret/conftest.py)."""
import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")


def _sm() -> int:
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor


def _cuda(batch):
    from dataclasses import replace

    return replace(batch, **{f: getattr(batch, f).cuda() for f in (
        "q", "k", "v", "k_cache", "v_cache", "slot_mapping", "block_tables", "context_lens",
        "query_start_loc")})


@pytest.mark.parametrize("dtype,cache,tol", [
    (torch.float32, torch.float32, 1e-4),
    (torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float16, torch.float16, 2e-2),
    (torch.bfloat16, torch.int8, 2e-2),
    (torch.bfloat16, torch.float8_e4m3fn, 2e-2),
])
@pytest.mark.parametrize("H,KVH,D,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (6, 2, 36, 8)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (33, 2.0)], ids=["global", "window-cap"])
def test_paged_attention_triton_matches_reference(dtype, cache, tol, H, KVH, D, bs, window,
                                                  softcap):
    from kiln.plugins.paged_kv import triton_attention  # noqa: F401
    from kiln.plugins.paged_kv.ops import paged_attention_reference
    from tests.helpers import MIXED, make_batch

    if cache == torch.float8_e4m3fn and _sm() < 89:
        pytest.skip("E4M3 needs sm_89")
    b = _cuda(make_batch(MIXED, H, KVH, D, bs, dtype=dtype, cache_dtype=cache, seed=D + bs))
    b.window, b.softcap = window, softcap
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    ref = paged_attention_reference(*b.args(ref_k, ref_v))
    out = torch.ops.kiln.paged_attention_triton(*b.args())
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
    assert torch.equal(raw(b.k_cache), raw(ref_k)) and torch.equal(raw(b.v_cache), raw(ref_v))


@pytest.mark.parametrize("scheme,gs", [("int8", None), ("fp8", None), ("int4", 32),
                                       ("int4", 128)])
@pytest.mark.parametrize("m", [1, 33, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_triton_matches_reference(scheme, gs, m, dtype):
    from kiln.plugins.quant import formats, ops

    if scheme == "fp8" and _sm() < 89:
        pytest.skip("E4M3 needs sm_89")
    g = torch.Generator().manual_seed(m)
    K = 768                                        # divisible by every int4 group size
    x = torch.randn(m, K, generator=g).to(dtype).cuda()
    qw = formats.quantize(torch.randn(1536, K, generator=g) * 0.05, scheme, gs)
    qw = formats.QuantizedWeight(qw.scheme, qw.qweight.cuda(), qw.scales.cuda(),
                                 None if qw.zeros is None else qw.zeros.cuda(), qw.group_size,
                                 qw.shape)
    out = ops.quant_linear(x, qw)                 # dispatches to the Triton op on CUDA
    args = (qw.qweight, qw.scales) + ((qw.zeros, qw.group_size) if scheme == "int4" else ())
    ref = ops.REFERENCES[scheme](x, *args)
    scale = ref.float().abs().max().item()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-5
    assert (out.float() - ref.float()).abs().max().item() <= tol * scale


def test_aoti_compiles_triton_ops_and_writes_pools_in_place(tmp_path):
    from torch.export import Dim

    from kiln.plugins.paged_kv import ops as pa_ops
    from kiln.plugins.quant import formats, ops as q_ops
    from tests.helpers import make_batch

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            qw = formats.quantize(torch.randn(64, 9 * 64) * 0.05, "int8")
            self.register_buffer("qweight", qw.qweight)
            self.register_buffer("scales", qw.scales)

        def forward(self, q, k, v, kc, vc, slots, bt, ctx, qsl):
            o = pa_ops.paged_attention(q, k, v, kc, vc, slots, bt, ctx, qsl, 0.125)
            w = formats.QuantizedWeight("int8", self.qweight, self.scales, None, None, (64, 576))
            return q_ops.quant_linear(o.reshape(o.shape[0], -1), w)

    model = Layer().cuda().eval()
    b = _cuda(make_batch([(3, 5), (10, 1)], 9, 3, 64, 16, dtype=torch.bfloat16,
                         cache_dtype=torch.bfloat16, max_seq_len=128))
    T, B = Dim("T", min=1, max=256), Dim("B", min=1, max=16)
    NB, MB = Dim("num_blocks", min=2, max=1 << 20), Dim("max_blocks", min=1, max=64)
    ep = torch.export.export(model, b.args()[:9], dynamic_shapes=(
        {0: T}, {0: T}, {0: T}, {0: NB}, {0: NB}, {0: T}, {0: B, 1: MB}, {0: B}, {0: B + 1}))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "kiln.paged_attention_triton.default" in targets
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "l.pt2"))
    runner = torch._inductor.aoti_load_package(pkg)
    ref_k, ref_v = b.k_cache.clone(), b.v_cache.clone()
    ref = model(*b.args(ref_k, ref_v)[:9])
    ptr = b.k_cache.data_ptr()
    out = runner(*b.args()[:9])
    assert b.k_cache.data_ptr() == ptr
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(b.k_cache, ref_k) and torch.equal(b.v_cache, ref_v)


def test_build_machine_check_passes_for_this_gpu():
    from kiln.builder import gpu
    from kiln.builder.spec import parse_spec

    major, minor = torch.cuda.get_device_capability()
    spec = parse_spec(f"""
name: t
model:
  source: random
  arch: {{vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
         num_attention_heads: 2}}
target: {{device: sm_{major}{minor}}}
precision: {{weights: bf16, activations: bf16}}
""")
    facts = gpu.check_build_machine(spec)
    assert facts.compute_capability == f"sm_{major}{minor}" and facts.cuda == torch.version.cuda


def test_decode_graphs_replay_equals_the_eager_step():
    from kiln.plugins.paged_kv import kv_format
    from kiln.runtime.cuda_graphs import DecodeGraphs
    from kiln.runtime.executor import ModelInput
    from tests.runtime_helpers import tiny_model

    model = tiny_model().cuda()
    cfg, bs, num_blocks = model.cfg, 16, 32
    pools = kv_format.new_pools("bf16", cfg.num_layers, num_blocks, bs, cfg.num_kv_heads,
                                cfg.head_dim, device="cuda")
    tables, ctx = [[3, 7], [1], [5, 9, 11]], [20, 9, 40]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in ctx]

    def on_cuda(inp):
        return ModelInput(*(t.cuda() for t in inp.args()))

    with torch.inference_mode():
        model(*on_cuda(ModelInput.build([p[:-1] for p in prompts], [0] * 3, tables, bs)).args(),
              *pools)
        decode = on_cuda(ModelInput.build([[p[-1]] for p in prompts], [n - 1 for n in ctx],
                                          tables, bs))
        plain = [[t.clone() for t in ps] for ps in pools]
        want = model(*decode.args(), *plain)
    graphs = DecodeGraphs(model, pools[0], pools[1], max_batch_size=8, max_blocks=4,
                          scratch_block=num_blocks - 1, tokens_per_block=bs)
    graphs.capture()
    assert graphs.can_run(decode)
    got = graphs.run(decode)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
