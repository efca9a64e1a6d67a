"""The accuracy gate's evaluation: perplexity and top-1 predictions of a plan's engine.

This side owns what `kiln verify` re-runs on a serving host (which has only the runtime): the
evaluation text and tokens, the scoring of a step function over them, the score against a
reference (`score` -> GateScore) and the re-run against what the build recorded
(`rerun_gate` -> GateRerun). The reference itself (the eager fp32 model of the checkpoint)
and the build's verdict are the builder's: builder/accuracy_reference.py.

The evaluation text needs no download: `pydoc` is Python's own pydoc_data/topics.py (the
help() topics, ~750 KB of English and code), joined in sorted topic order. It is tokenized
with the plan's tokenizer (no special tokens), cut to `eval_tokens` tokens, and split into
windows of `window` tokens (min(max_num_tokens, max_seq_len, 512)); **each window is a fresh
sequence** (no sliding context), so every window scores window - 1 next-token predictions.

Scoring one window (`evaluate`): the window is one engine step of one sequence, packed by
ModelInput.build like any serving step, asking for the logits of every position but the last
(the step's logits rows have their own dynamic dim, up to max_num_tokens):

    input_ids = t_0 .. t_{W-1}   positions 0 .. W-1   block_tables = [the window's blocks]
    logits_indices = 0 .. W-2    -> W - 1 rows: row p predicts t_{p+1}

The KV pool is the plan's dtype, sized for one window (block 0 unused). `evaluate` takes any
step function: the compiled plan's, or the eager model's (the builder's reference and AWQ
calibration).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from kiln.contracts.reports import GateRerun, GateScore
from kiln.runtime.executor import Executor, KVLayout, ModelInput
from kiln.runtime.lora_buffers import base_only
from kiln.runtime.plan import Plan, load_step_fn

EVAL_TEXTS = ("pydoc",)
MAX_WINDOW = 512
REFERENCE_FILE = "accuracy/reference_top1.bin"   # int32 little-endian, one per prediction
DRIFT_TOLERANCE = 0.02     # kiln verify: largest relative change of ppl since the build


def eval_text(name: str) -> str:
    """The named evaluation text (`pydoc`: Python's pydoc_data/topics.py topics)."""
    if name != "pydoc":
        raise ValueError(f"unknown evaluation text {name!r}; allowed: {', '.join(EVAL_TEXTS)}")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_ids(ids: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


def eval_ids(encode: Callable[[str], list[int]], text: str, n: int) -> list[int]:
    """The first n token ids of text (ValueError if the text is shorter)."""
    ids = encode(text)
    if len(ids) < n:
        raise ValueError(f"the evaluation text has {len(ids)} tokens; accuracy.eval_tokens "
                         f"asks for {n}")
    return ids[:n]


def window_size(max_num_tokens: int, max_seq_len: int) -> int:
    """Tokens per evaluation window: one engine step, one sequence."""
    return min(MAX_WINDOW, max_num_tokens, max_seq_len)


def windows(ids: Sequence[int], window: int) -> list[list[int]]:
    """Consecutive windows of `window` tokens (a last shorter one if >= 2 tokens)."""
    out = [list(ids[i:i + window]) for i in range(0, len(ids), window)]
    return [w for w in out if len(w) >= 2]


@dataclass
class EvalResult:
    """Next-token scores over the evaluation windows."""
    nll_sum: float          # sum of -log p(next token)
    count: int              # predictions scored
    top1: list[int]         # argmax prediction of each, in order

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.count)


def score_logits(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, list[int]]:
    """(sum of -log p(targets), argmax ids) of logits [N, vocab]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(1, targets[:, None]).sum().item()
    return nll, logp.argmax(dim=-1).tolist()


def eval_layout(num_layers: int, num_kv_heads: int, head_dim: int, window: int,
                tokens_per_block: int, kv_dtype: str,
                pool_order: str = KVLayout.pool_order) -> KVLayout:
    """The KV pools that hold one evaluation window (block 0 unused), in a plan's pool order
    (the default: a plan built now)."""
    blocks = -(-window // tokens_per_block)
    return KVLayout(num_layers, blocks + 1, tokens_per_block, num_kv_heads, head_dim, kv_dtype,
                    pool_order)


@torch.inference_mode()
def evaluate(step_fn, layout: KVLayout, ids: Sequence[int], window: int) -> EvalResult:
    """Scores `ids` through any engine step function -- the compiled plan's, or the eager
    model (the reference, AWQ calibration) -- packed by ModelInput.build like serving:
    each window one step of one fresh sequence, logits at every position but the last."""
    ex = Executor(step_fn, layout)
    table = list(range(1, layout.num_blocks))    # block 0 unused
    nll, count, top1 = 0.0, 0, []
    for win in windows(ids, window):
        n = len(win) - 1                         # predictions in this window
        inp = ModelInput.build([win], [0], [table], layout.tokens_per_block,
                               logits_indices=range(n))
        logits = ex.execute(inp)                 # [n, vocab]
        s, am = score_logits(logits, torch.tensor(win[1:]))
        nll += s
        count += n
        top1 += am
    return EvalResult(nll, count, top1)


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"top-1 lists differ in length ({len(a)} vs {len(b)})")
    return sum(x == y for x, y in zip(a, b)) / len(a)


def write_top1(path: Path, top1: Sequence[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack(f"<{len(top1)}i", *top1))


def read_top1(data: bytes) -> list[int]:
    """The reference's top-1 predictions from REFERENCE_FILE's bytes."""
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def score(plan_res: EvalResult, ref_ppl: float, ref_top1: Sequence[int],
          max_ppl_increase: float) -> GateScore:
    """A plan's result measured against its reference's."""
    increase = plan_res.ppl / ref_ppl - 1.0
    return GateScore(ppl=plan_res.ppl, ref_ppl=ref_ppl, ppl_increase=increase,
                     max_ppl_increase=max_ppl_increase,
                     top1_agreement=agreement(plan_res.top1, ref_top1),
                     tokens=plan_res.count, passed=increase <= max_ppl_increase)


def rerun_gate(plan: Plan, step_fn=None) -> GateRerun:
    """Re-measure the plan's ppl and top-1 agreement on the recorded evaluation tokens.

    The baseline is what the build recorded: ref_ppl and the reference's top-1 predictions
    (REFERENCE_FILE). ok = the increase is within max_ppl_increase and the plan's ppl moved
    at most DRIFT_TOLERANCE (relative) from the build's measurement."""
    from kiln.runtime.tokenizer import Tokenizer

    m = plan.manifest
    recorded = m.accuracy
    if not recorded:
        raise ValueError(f"plan {plan.path} recorded no accuracy gate")
    text = eval_text(recorded.text)
    if sha256_text(text) != recorded.text_sha256:
        raise ValueError(f"the evaluation text {recorded.text!r} on this machine differs "
                         "from the build's (another Python version?); cannot compare")
    tok = Tokenizer.from_plan(plan)
    ids = eval_ids(lambda t: tok.encode(t, add_special_tokens=False), text,
                   recorded.eval_tokens)
    if sha256_ids(ids) != recorded.ids_sha256:
        raise ValueError("the evaluation tokens differ from the build's (tokenizer changed?)")
    if step_fn is None:
        step_fn = load_step_fn(plan)
        if m.lora is not None:                      # the gate scores the base model
            step_fn = base_only(step_fn, m.lora, plan.shape.num_layers)
    shape, window = plan.shape, window_size(m.limits.max_num_tokens, m.limits.max_seq_len)
    layout = eval_layout(shape.num_layers, shape.num_kv_heads, shape.head_dim, window,
                         m.kv_cache.tokens_per_block, m.kv_cache.dtype, m.kv_cache.pool_order)
    res = evaluate(step_fn, layout, ids, window)
    got = score(res, recorded.ref_ppl, read_top1(plan.data_file(REFERENCE_FILE)),
                recorded.max_ppl_increase)
    drift = got.ppl / recorded.ppl - 1.0
    summary = got.describe(recorded.text) + f"; {drift:+.2%} vs the build's ppl {recorded.ppl:.3f}"
    if abs(drift) > DRIFT_TOLERANCE:
        summary += f" (more than {DRIFT_TOLERANCE:.0%}: the plan changed)"
    return GateRerun(**dataclasses.asdict(got), text=recorded.text, drift=drift,
                     ok=bool(got.passed and abs(drift) <= DRIFT_TOLERANCE), summary=summary)
