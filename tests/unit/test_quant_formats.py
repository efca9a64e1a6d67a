"""Quantize -> dequantize round trips of plugins/quant/formats.py, within each scheme's bound."""
import pytest
import torch

from kiln.plugins.quant import formats

pytestmark = pytest.mark.unit

SCHEMES = [("int8", None), ("fp8", None), ("int4", 32), ("int4", 64), ("int4", 128),
           ("bf16", None), ("int4_a8", None), ("fp32", None)]


def _weights(kind: str, n=48, k=256) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(kind) % 1000)
    w = torch.randn(n, k, generator=g) * 0.05
    if kind == "outliers":
        w[::3, 7] = 40.0
        w[1::5, 200] = -90.0
    elif kind == "zero_rows":
        w[0] = 0
        w[5] = 0
        w[9, :128] = 0                     # all-zero groups inside a non-zero row
    elif kind == "tiny":
        w = w * 1e-30
        w[2] = 1e-41                       # float32 subnormals
    elif kind == "constant_groups":
        w[:, :64] = 0.3
        w[:, 64:128] = -2.0
    elif kind == "one_sided":
        w = w.abs() + 1.0
    return w


@pytest.mark.parametrize("scheme,gs", SCHEMES)
@pytest.mark.parametrize("kind", ["random", "outliers", "zero_rows", "tiny", "constant_groups",
                                  "one_sided"])
def test_round_trip_within_bound(scheme, gs, kind):
    w = _weights(kind)
    qw = formats.quantize(w, scheme, gs)
    deq = formats.dequantize(qw)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    assert torch.isfinite(deq).all()
    err = (w - deq).abs()
    bound = formats.error_bound(w, qw) * (1 + 1e-5) + 1e-45
    worst = (err - bound).max()
    assert worst <= 0, f"{scheme} g={gs} {kind}: error exceeds bound by {worst.item():.3g}"
    if kind == "zero_rows":
        assert (deq[0] == 0).all() and (deq[5] == 0).all() and (deq[9, :128] == 0).all()


@pytest.mark.parametrize("scheme,gs", SCHEMES)
def test_relative_error_on_gaussian_weights(scheme, gs):
    w = _weights("random", 256, 512)
    deq = formats.dequantize(formats.quantize(w, scheme, gs))
    rel = ((w - deq).norm() / w.norm()).item()
    limit = {"int8": 0.01, "fp8": 0.04, "int4": 0.12, "bf16": 0.003, "int4_a8": 0.12,
             "fp32": 1e-9}[scheme]
    assert rel < limit, f"{scheme}: relative Frobenius error {rel:.4f} >= {limit}"


def test_int4_a8_layout_and_q4_1_weights_round_trip_exactly():
    """The interleaved layout puts row r, k = 8c + j (low) / 8c + 4 + j (high) at byte
    64c + 4r + j of each group's 256 bytes; weights of Q4_1 form (fp16 scale and minimum,
    codes 0..15 hitting both ends) come back bit for bit."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (32, 64), generator=g)
    packed = formats.pack_int4_a8(q)
    assert packed.shape == (2, 2, 256) and packed.dtype == torch.uint8
    assert packed[1, 1, 64 * 2 + 4 * 5 + 3] == q[16 + 5, 32 + 16 + 3] | (q[16 + 5, 32 + 20 + 3] << 4)
    assert torch.equal(formats.unpack_int4_a8(packed).long(), q)
    d = (torch.rand(32, 2, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(32, 2, generator=g) * 0.1).half().float()
    q[:, 0], q[:, 31], q[:, 32], q[:, 63] = 0, 15, 0, 15
    w = q.float().reshape(32, 2, 32) * d[..., None] + m[..., None]
    qw = formats.quantize(w.reshape(32, 64), "int4_a8")
    assert torch.equal(formats.dequantize(qw), w.reshape(32, 64))
    assert torch.equal(formats.unpack_int4_a8(qw.qweight).long(), q)
    with pytest.raises(ValueError, match="N % 16"):
        formats.quantize(torch.randn(24, 64), "int4_a8")


def test_storage_dtypes_and_shapes():
    w = _weights("random", 64, 256)
    q8 = formats.quantize(w, "int8")
    assert q8.qweight.dtype == torch.int8 and q8.scales.shape == (64,)
    f8 = formats.quantize(w, "fp8")
    assert f8.qweight.dtype == torch.float8_e4m3fn and f8.scales.shape == (64,)
    q4 = formats.quantize(w, "int4", 64)
    assert q4.qweight.dtype == torch.uint8 and q4.qweight.shape == (64, 128)
    assert q4.scales.shape == q4.zeros.shape == (64, 4)
    # float zero points: code 0 dequantizes to each group's minimum
    assert torch.allclose(-q4.zeros * q4.scales, w.reshape(64, 4, 64).amin(dim=2), atol=1e-6)


def test_int4_q4_1_weights_come_back_and_constant_groups_are_exact():
    """int4 weight-only at group 32 stores weights of Q4_1 form (scale d and minimum m per
    group, codes 0..15 hitting both ends) to within float rounding of (q - z) * s, codes
    exactly; constant and all-zero groups come back exactly."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (8, 64), generator=g)
    q[:, 0], q[:, 31], q[:, 32], q[:, 63] = 0, 15, 0, 15
    d = (torch.rand(8, 2, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(8, 2, generator=g) * 0.1).half().float()
    w = (q.float().reshape(8, 2, 32) * d[..., None] + m[..., None]).reshape(8, 64)
    qw = formats.quantize(w, "int4", 32)
    assert torch.equal(formats.unpack_int4(qw.qweight).long(), q)
    assert torch.allclose(formats.dequantize(qw), w, rtol=0, atol=1e-7)
    c = torch.zeros(2, 64)
    c[0, :32], c[1] = 0.37, -5.0
    assert torch.equal(formats.dequantize(formats.quantize(c, "int4", 32)), c)


def test_int4_packing_layout():
    q = torch.arange(64).remainder(16).reshape(1, 64)
    packed = formats.pack_int4(q)
    # block 0, byte j: q[j] low nibble, q[16 + j] high nibble
    assert packed[0, 0].item() == (q[0, 0] | (q[0, 16] << 4)).item()
    assert packed[0, 17].item() == (q[0, 33] | (q[0, 49] << 4)).item()
    assert torch.equal(formats.unpack_int4(packed), q.to(torch.uint8))


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_group_size_not_dividing_k_raises(gs):
    w = torch.randn(8, 96 + 16 if gs == 32 else 96)
    if w.shape[1] % gs == 0:
        pytest.skip("divides")
    with pytest.raises(ValueError, match="group_size"):
        formats.quantize(w, "int4", gs)


def test_group_size_not_allowed_raises():
    with pytest.raises(ValueError, match="group_size"):
        formats.quantize(torch.randn(8, 96), "int4", 48)


def test_unknown_scheme_raises():
    with pytest.raises(ValueError, match="int8"):
        formats.quantize(torch.randn(4, 32), "int3")


# ---------------------------------------------------------------- builder/quantize.py

def _tiny_llama():
    from kiln.builder.arch.llama import LlamaConfig, LlamaModel
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    torch.manual_seed(0)
    return LlamaModel(cfg).eval()


def _run(model, T=8, bs=4):
    """One prefill step of a single T-token sequence -> logits [1, vocab]."""
    cfg = model.cfg
    nblk = (T + bs - 1) // bs
    caches = [torch.zeros(nblk, bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    ids = torch.arange(T) % cfg.vocab_size
    with torch.no_grad():
        return model(ids, torch.arange(T), torch.arange(T), torch.arange(nblk)[None],
                     torch.tensor([T]), torch.tensor([0, T]), torch.tensor([T - 1]),
                     caches[:cfg.num_layers], caches[cfg.num_layers:])


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8", "bf16"])
def test_quantize_model_swaps_linears_and_keeps_outputs_close(scheme):
    from kiln.builder.quantize import quantize_model
    from kiln.plugins.quant.modules import QuantLinear
    model = _tiny_llama()
    ref = _run(model)
    report = quantize_model(model, scheme, calibration=_run if scheme == "int4" else None)
    assert len(report.quantized) == 8 and "output" not in report.quantized
    assert isinstance(model.layers[0].feed_forward.w2, QuantLinear)
    assert model.output is None                                  # lm_head kept (tied)
    assert report.group_size == (32 if scheme == "int4" else None)   # largest dividing 64, 96
    assert report.method == ("awq" if scheme == "int4" else "rtn")
    assert report.bytes_after < report.bytes_before
    out = _run(model)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < {"int8": 0.02, "fp8": 0.06, "int4": 0.25, "bf16": 0.005}[scheme], rel


def test_bf16_model_stores_every_weight_bf16_and_the_tied_head_shares_the_table():
    from kiln.builder.quantize import quantize_model
    from kiln.plugins.quant.modules import QuantEmbedding
    model = _tiny_llama()
    ref = _run(model)
    report = quantize_model(model, "bf16", keep_high_precision=())
    assert report.embedding == "bf16" and report.bf16_compute == "upcast-fp32"
    assert isinstance(model.tok_embeddings, QuantEmbedding)
    assert model.tok_embeddings.qweight.dtype == torch.bfloat16
    assert model.output.qweight is model.tok_embeddings.qweight
    assert report.lm_head == "bf16 (the tied embedding's table)"
    assert report.bytes_after * 2 <= report.bytes_before
    out = _run(model)
    assert ((out - ref).norm() / ref.norm()).item() < 0.005


@pytest.mark.parametrize("via", ["weight", "awq_scale"])
def test_int4_linear_beyond_float16_keeps_the_nk2_layout_alone(via, monkeypatch):
    """int4 at group 32 on a CPU target stores the interleaved format per linear: one whose
    weight as quantized (after its AWQ scale) exceeds float16 keeps the [N, K/2] layout, is
    named in the report, and still multiplies right; the others stay interleaved."""
    import kiln.builder.quantize as bq
    model = _tiny_llama()
    odd = "layers.0.attention.wqkv"
    lin = model.get_submodule(odd)
    x = torch.randn(16, lin.in_features)
    ref = lin(x)
    calibration = None
    if via == "weight":
        with torch.no_grad():
            lin.weight[3, 5] = 1e5
        ref = lin(x)
    else:
        real = bq.awq_search

        def search(w, acts, scheme, gs):
            if w is lin.weight:          # a scale that sends channel 5 past float16 once divided
                s = torch.ones(w.shape[1])
                s[5] = 1e-7
                return s, 0.5
            return real(w, acts, scheme, gs)
        monkeypatch.setattr(bq, "awq_search", search)
        calibration = _run
    report = bq.quantize_model(model, "int4", calibration=calibration)
    assert report.scheme == "int4_a8" and report.int4_layout_kept == (odd,)
    q = model.get_submodule(odd)
    assert q.scheme == "int4" and q.group_size == 32
    assert model.layers[0].attention.wo.scheme == "int4_a8"
    from kiln.runtime.tools.inspect import _scheme      # `kiln inspect` says so
    assert "1 linear(s) in the int4 [N, K/2] layout" in _scheme(report)
    if via == "weight":
        rel = ((q(x) - ref).norm() / ref.norm()).item()
        assert rel < 0.2, rel


def test_quantize_model_group_size_error_names_layer_and_group_size():
    from kiln.builder.quantize import quantize_model
    model = _tiny_llama()
    with pytest.raises(ValueError, match=r"w2: int4 group_size 64 does not divide"):
        quantize_model(model, "int4", group_size=64)


def test_quantize_model_lm_head_and_keep_list():
    from kiln.builder.quantize import quantize_model
    from kiln.plugins.quant.modules import QuantLinear
    model = _tiny_llama()
    report = quantize_model(model, "int8", keep_high_precision=("embed", "w2"))
    assert isinstance(model.output, QuantLinear)             # tied head got a quantized copy
    assert isinstance(model.tok_embeddings, torch.nn.Embedding)
    assert not isinstance(model.layers[1].feed_forward.w2, QuantLinear)
    assert "output" in report.quantized
    with pytest.raises(ValueError, match="nope"):
        quantize_model(_tiny_llama(), "int8", keep_high_precision=("embed", "lm_head", "nope"))


def test_awq_search_never_worse_than_rtn():
    from kiln.builder.quantize import awq_search
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 128, generator=g) * (torch.rand(128, generator=g) * 10) ** 2
    w = torch.randn(64, 128, generator=g)
    s, alpha = awq_search(w, x, "int4", 32)
    rtn = formats.dequantize(formats.quantize(w, "int4", 32))
    awq = formats.dequantize(formats.quantize(w * (1 / s)[None], "int4", 32)) * s[None]
    err = lambda wq: (x @ (w - wq).T).pow(2).mean().item()
    assert err(awq) <= err(rtn) * 1.0001 and 0.0 <= alpha <= 1.0


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 128), ("int4", 32),
                                               ("fp8", None), ("int4_a8", None)])
def test_a_tall_weight_is_quantized_by_rows_to_the_same_result(scheme, group_size):
    # more rows than QUANTIZE_ROWS, and a last chunk of 48: the same bytes as one pass
    w = torch.randn(2 * formats.QUANTIZE_ROWS + 48, 256,
                    generator=torch.Generator().manual_seed(0)) * 0.05
    by_rows, whole = formats.quantize(w, scheme, group_size), formats._quantize(w, scheme,
                                                                                 group_size)
    assert (by_rows.shape, by_rows.group_size) == (whole.shape, whole.group_size)
    for field in ("qweight", "scales", "zeros"):
        a, b = getattr(by_rows, field), getattr(whole, field)
        assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match=r"\[N, K\] = \[16392, 256\]"):
        formats.quantize(torch.zeros(16392, 256), "int4_a8")


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8", "int4_a8", "bf16", "fp32"])
@pytest.mark.parametrize("rows", [64, 2 * formats.QUANTIZE_ROWS + 32])
def test_a_bf16_weight_quantizes_as_its_float32_widening(scheme, rows):
    # a streamed build hands the checkpoint's bf16 weight over; widened block by block it
    # must give the bytes the whole float32 weight gives
    w = (torch.randn(rows, 128, generator=torch.Generator().manual_seed(1)) * 0.05
         ).to(torch.bfloat16)
    a, b = formats.quantize(w, scheme), formats.quantize(w.float(), scheme)
    assert (a.shape, a.group_size, a.scheme) == (b.shape, b.group_size, b.scheme)
    for field in ("qweight", "scales", "zeros"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(
            x.view(torch.uint8), y.view(torch.uint8))), field
