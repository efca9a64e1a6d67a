"""Decode-step padding for CUDA graphs (runtime/cuda_graphs.py), checked on the CPU with the
eager model: padded rows change nothing but the scratch block, real rows keep their logits.
(Capture and replay themselves need CUDA: tests/gpu.)"""
import pytest
import torch

from kiln.plugins.paged_kv import kv_format
from kiln.runtime.cuda_graphs import batch_ladder, is_decode_only, pad_decode_batch
from kiln.runtime.executor import STEP_INPUTS, ModelInput
from tests.runtime_helpers import tiny_model

pytestmark = pytest.mark.unit
FIELDS = tuple(s.name for s in STEP_INPUTS)


def test_ladder_covers_every_batch_size_with_bounded_padding():
    for max_bs in (1, 3, 8, 32, 100, 256):
        sizes = batch_ladder(max_bs)
        assert sizes[0] == 1 and sizes[-1] == max_bs and sizes == sorted(set(sizes))
        for b in range(1, max_bs + 1):
            s = next(s for s in sizes if s >= b)
            assert s - b <= max(7, b // 4 + 1), (max_bs, b, s)
    assert batch_ladder(256)[:6] == [1, 2, 4, 8, 16, 24]


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_padded_decode_step_equals_the_unpadded_one(kv):
    model = tiny_model()
    cfg = model.cfg
    bs, num_blocks = 16, 24
    scratch = num_blocks - 1
    g = torch.Generator().manual_seed(0)
    pools = kv_format.new_pools(kv, cfg.num_layers, num_blocks, bs, cfg.num_kv_heads,
                                cfg.head_dim)
    tables = [[3, 7], [1], [5, 9, 11]]
    ctx = [20, 9, 40]
    # prefill everything but the last token of each sequence, then decode one token each
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in ctx]
    with torch.no_grad():
        model(*ModelInput.build([p[:-1] for p in prompts], [0] * 3, tables, bs).args(), *pools)
        decode = ModelInput.build([[p[-1]] for p in prompts], [n - 1 for n in ctx], tables, bs)
        assert is_decode_only(decode)
        before = [[t.clone() for t in ps] for ps in pools]
        plain = [[t.clone() for t in ps] for ps in pools]
        want = model(*decode.args(), *plain)
        padded = pad_decode_batch(decode, 8, 4, scratch, bs)
        assert padded.input_ids.shape == (8,) and padded.block_tables.shape == (8, 4)
        got = model(*padded.args(), *pools)
    torch.testing.assert_close(got[:3], want, atol=1e-4, rtol=1e-4)
    step_slots = set(decode.slot_mapping.tolist())
    untouched = [s for s in range(scratch * bs) if s not in step_slots]
    raw = (lambda t: t.view(torch.uint8)) if pools[0][0].element_size() == 1 else (lambda t: t)
    for mine, old, theirs in zip(pools[0] + pools[1], before[0] + before[1], plain[0] + plain[1]):
        flat = lambda t: raw(t).reshape(num_blocks * bs, *t.shape[2:])  # noqa: E731
        # padding wrote nothing outside the scratch block and this step's own slots ...
        assert torch.equal(flat(mine)[untouched], flat(old)[untouched])
        assert not torch.equal(raw(mine[scratch]), raw(old[scratch]))
        # ... and the step's slots hold what the unpadded step wrote (up to the roundings of
        # a wider matmul: an int8 code may move by one step)
        slots = decode.slot_mapping
        torch.testing.assert_close(kv_format.decode(mine.reshape(-1, *mine.shape[2:])[slots]),
                                   kv_format.decode(theirs.reshape(-1, *mine.shape[2:])[slots]),
                                   atol=0.05, rtol=0.02)


def test_mixed_batches_are_not_padded():
    mixed = ModelInput.build([[1, 2, 3], [4]], [0, 5], [[0], [1]], 16)
    assert not is_decode_only(mixed)
    with pytest.raises(ValueError, match="decode-only"):
        pad_decode_batch(mixed, 4, 2, 7, 16)
    decode = ModelInput.build([[1]] * 5, [3] * 5, [[i] for i in range(5)], 16)
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_batch(decode, 4, 2, 7, 16)


def test_a_reused_buffer_is_reset_to_padding_beyond_each_batch():
    """A graph's buffers serve batch after batch: what a wider batch wrote (rows, block-table
    columns) goes back to padding when a narrower one is loaded."""
    from kiln.runtime.cuda_graphs import _Buffers

    wide = ModelInput.build([[5], [6], [7]], [20, 9, 40], [[3, 7], [1], [5, 9, 11]], 16)
    narrow = ModelInput.build([[8]], [4], [[2]], 16)
    buf = _Buffers(4, 3, 23, 16, "cpu")
    buf.load(wide)
    buf.load(narrow)
    fresh = pad_decode_batch(narrow, 4, 3, 23, 16)
    for name, a, b in zip(FIELDS, buf.step.args(), fresh.args()):
        assert torch.equal(a, b), name
    assert buf.step.block_tables.tolist() == [[2, 23, 23]] + [[23] * 3] * 3
    assert buf.step.slot_mapping.tolist() == [2 * 16 + 4] + [23 * 16] * 3
