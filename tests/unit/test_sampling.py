"""SamplingParams validation and the batched sampler (logits made by hand)."""
import pytest
import torch

from kiln.runtime.sampling import Sampler, SamplingParams, SamplingState

pytestmark = pytest.mark.unit
V = 32


def run(logits, params, histories=None, n_prompt=None, stop_ids=()):
    states = [SamplingState.create(p, stop_ids) for p in params]
    hist = histories or [[1, 2, 3]] * len(params)
    n_prompt = n_prompt or [len(h) for h in hist]
    return Sampler()(logits, states, hist, n_prompt)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -1), ("top_p", 0), ("top_k", -2), ("min_p", 2),
    ("repetition_penalty", 0), ("presence_penalty", 3), ("min_tokens", 99), ("seed", "x"),
    ("stop", [""]), ("stop_token_ids", [-1])])
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_from_dict_rejects_unknown():
    with pytest.raises(ValueError, match="top_q"):
        SamplingParams.from_dict({"top_q": 1})
    assert SamplingParams.from_dict({"stop": "x"}).stop == ("x",)


def test_greedy_and_masks():
    logits = torch.zeros(3, V)
    logits[:, 5] = 3.0
    logits[:, 6] = 2.0
    p_greedy = SamplingParams(temperature=0)
    p_min = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    p_bad = SamplingParams(temperature=0, bad_token_ids=(5,))
    out = run(logits, [p_greedy, p_min, p_bad], stop_ids=(5,))
    assert out == [5, 6, 6]


def test_bad_word_sequence_bans_last_token_after_prefix():
    logits = torch.zeros(2, V)
    logits[:, 9] = 5.0
    st = SamplingState.create(SamplingParams(temperature=0), bad_words_ids=[[4, 9]])
    out = Sampler()(logits, [st, st], [[1, 4], [1, 3]], [1, 1])
    assert out[0] != 9 and out[1] == 9


def test_penalties():
    logits = torch.zeros(1, V)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.9
    # token 3 was generated: frequency penalty pushes it below 4
    assert run(logits, [SamplingParams(temperature=0, frequency_penalty=0.5)],
               [[0, 3]], [1]) == [4]
    assert run(logits, [SamplingParams(temperature=0, presence_penalty=0.5)], [[0, 3]], [1]) == [4]
    assert run(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)], [[3]], [1]) == [4]
    assert run(logits, [SamplingParams(temperature=0)], [[0, 3]], [1]) == [3]


def test_top_k_top_p_min_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.randn(1, V).repeat(200, 1)
    top = logits[0].argsort(descending=True)
    for params, allowed in [(SamplingParams(top_k=3), set(top[:3].tolist())),
                            (SamplingParams(top_k=1), {int(top[0])}),
                            (SamplingParams(top_p=1e-6), {int(top[0])}),
                            (SamplingParams(min_p=0.999), {int(top[0])})]:
        out = run(logits, [params] * 200)
        assert set(out) <= allowed, params
    out = run(logits, [SamplingParams(top_k=3)] * 200)
    assert len(set(out)) == 3          # samples, not argmax


def test_temperature_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.full((3000, V), -1e9)
    logits[:, :3] = probs.log()
    out = torch.tensor(run(logits, [SamplingParams(temperature=1.0)] * 3000))
    freq = torch.bincount(out, minlength=3)[:3].float() / 3000
    assert torch.allclose(freq, probs, atol=0.04)


def test_seed_independent_of_batch_companions():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    p = SamplingParams(temperature=1.0, seed=1234)
    st = SamplingState.create(p)
    seq_alone = [Sampler()(logits[1:2], [st], [[1]], [1])[0] for _ in range(10)]
    st = SamplingState.create(p)
    others = [SamplingState.create(SamplingParams(temperature=1.0)) for _ in range(3)]
    seq_batched = [Sampler()(logits, [others[0], st, others[1], others[2]],
                             [[1]] * 4, [1] * 4)[1] for _ in range(10)]
    assert seq_batched == seq_alone and len(set(seq_alone)) > 1


def test_greedy_ties_nan_and_mixed_batches_pick_as_torch_argmax_does():
    """The greedy path takes the argmax through numpy: same first-maximum tie rule and NaN
    rule as torch.argmax, in an all-greedy batch and in a mixed one."""
    logits = torch.zeros(4, V)
    logits[0, [3, 9]] = 2.0                       # a tie: the first index wins
    logits[1, 7] = float("nan")                   # NaN counts as the maximum
    logits[2, V - 1] = 1.0
    logits[3] = torch.arange(V, dtype=torch.float32).flip(0)
    expected = logits.argmax(dim=-1).tolist()
    assert expected == [3, 7, V - 1, 0]
    greedy = SamplingParams(temperature=0)
    assert run(logits, [greedy] * 4) == expected
    mixed = [greedy, greedy, SamplingParams(temperature=1.0, seed=1), greedy]
    out = run(logits[[0, 2, 2, 3]], mixed)
    assert out[0] == 3 and out[1] == V - 1 and out[3] == 0 and 0 <= out[2] < V


def test_greedy_fast_path_keeps_the_min_tokens_mask_until_it_lapses():
    """Plain greedy rows take the raw argmax (no logits copy); a row whose argmax is a stop id
    still masked by min_tokens goes through the masked path, in the same batch."""
    logits = torch.zeros(3, V)
    logits[:, 5] = 3.0
    logits[:, 6] = 2.0
    logits[2, 5] = float("nan")                   # NaN at the masked stop id: masked too
    p_min = SamplingParams(temperature=0, min_tokens=2, max_tokens=8)
    hist = [[1, 2, 3], [1, 2, 3, 9, 9], [1, 2, 3, 9]]     # 0, 2 and 1 tokens generated
    states = [SamplingState.create(p_min, (5,)) for _ in range(3)]
    assert all(s.plain_greedy for s in states)
    assert Sampler()(logits, states, hist, [3, 3, 3]) == [6, 5, 6]
    assert Sampler()(logits[1:2], states[1:2], hist[1:2], [3]) == [5]
    assert not SamplingState.create(SamplingParams(temperature=0, bad_token_ids=(4,))).plain_greedy
    assert not SamplingState.create(SamplingParams(temperature=0,
                                                   repetition_penalty=1.2)).plain_greedy


def _top_p_support(logits_row: torch.Tensor, top_p: float) -> set[int]:
    """The tokens top_p keeps by its definition: sorted by probability, a token is dropped
    when the mass strictly before it already reaches top_p."""
    p = logits_row.softmax(dim=-1)
    sp, si = p.sort(descending=True)
    keep = (sp.cumsum(dim=0) - sp) < top_p
    return set(si[keep].tolist())


@pytest.mark.parametrize("top_p", [0.3, 0.97])
def test_top_p_past_the_candidates_sorts_the_row_whole(top_p):
    """The top-p mass is looked for among a row's 256 most likely tokens first; a flat row
    (over 900 tokens needed at 0.97) is sorted whole. Either way the draws stay inside the
    tokens the definition keeps, and reach past the first 256 when the definition does."""
    vocab = 2048
    logits = torch.full((400, vocab), float("-inf"))
    logits[:, :1200] = torch.linspace(0.0, 2.0, 1200)     # distinct, gently sloped
    allowed = _top_p_support(logits[0], top_p)
    states = [SamplingState.create(SamplingParams(top_p=top_p)) for _ in range(400)]
    out = Sampler()(logits, states, [[1]] * 400, [1] * 400)
    assert set(out) <= allowed
    if len(allowed) > 256:
        assert len(set(out)) > 256
    peaked = torch.randn(1, vocab) * 8                   # mass reached within the candidates
    out = Sampler()(peaked.repeat(200, 1), [SamplingState.create(SamplingParams(top_p=0.5))
                                            for _ in range(200)], [[1]] * 200, [1] * 200)
    assert set(out) <= _top_p_support(peaked[0], 0.5)


def test_rows_with_nothing_to_draw_from_take_their_argmax():
    """A sampled row whose logits are all -inf or hold a NaN cannot be drawn from: it takes
    the argmax (as torch.argmax picks it) and the rows beside it sample as usual."""
    logits = torch.zeros(3, V)
    logits[0] = float("-inf")
    logits[1, 4] = float("nan")
    logits[2, 9] = 50.0
    out = run(logits, [SamplingParams(temperature=1.0)] * 3)
    assert out == [0, 4, 9]


def test_seeded_draws_repeat_and_follow_the_distribution():
    """One uniform number a row from the request's generator: the same seed gives the same
    tokens, and draws over many seeds follow the softmax."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.full((1, V), float("-inf"))
    logits[0, :4] = probs.log()
    draw = lambda seed: [Sampler()(logits, [st], [[1]], [1])[0]     # noqa: E731
                         for st in [SamplingState.create(SamplingParams(seed=seed))]
                         for _ in range(5)]
    assert draw(7) == draw(7)
    out = torch.tensor([draw(s)[0] for s in range(2000)])
    assert torch.allclose(torch.bincount(out, minlength=4)[:4].float() / 2000, probs, atol=0.04)
