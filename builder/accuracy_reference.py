"""The build's side of the accuracy gate: the unquantized reference, the verdict, calibration.

    ids = the evaluation text's first eval_tokens_for(accuracy, params) tokens (by model size
          unless the spec sets accuracy.eval_tokens; runtime/accuracy_gate.py)
    reference = eager fp32 model of the same checkpoint on the same windows   (cached; needs
                the checkpoint, so it is computed here and recorded in the plan); run one
                decoder layer at a time when no fp32 model is at hand
                (builder/layerwise_reference.py: the same numbers, one layer's weights held)
    plan      = the compiled engine
    both scored by runtime/accuracy_gate.py `evaluate`, compared by its `score`
    -> GateScore; over the limit: BuildError (gate_message; no plan is written); else
       Gate.record -> PlanManifest.accuracy, which `kiln verify` re-runs with the runtime alone

The reference (ppl + top-1 predictions) is cached under $XDG_CACHE_HOME/kiln/accuracy
(default ~/.cache/kiln/accuracy), keyed by the weights digest, the text digest, the token
count, the window and the tokenizer digest, so rebuilds and several precisions of one
checkpoint pay for it once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from kiln.builder import layerwise_reference as layerwise
from kiln.builder.spec import eval_tokens_for
from kiln.contracts.manifest import AccuracyRecord
from kiln.contracts.reports import GateScore
from kiln.plugins.paged_kv import kv_format
from kiln.runtime import accuracy_gate as racc

REFERENCE_VERSION = 1      # bump when the reference computation changes
CALIBRATION_TOKENS = 1024  # AWQ calibration tokens (taken after the evaluation tokens)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln" / "accuracy"


def encoder(tokenizer_json: str) -> Callable[[str], list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def eager_layout(model: torch.nn.Module, window: int, tokens_per_block: int = 16):
    """The KV pools of one evaluation window for the eager model (in its dtype)."""
    cfg = model.cfg
    return racc.eval_layout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, window,
                            tokens_per_block, kv_format.name_of(next(model.parameters()).dtype))


def reference_key(weights_digest: str, text_sha: str, n_tokens: int, window: int,
                  tokenizer_json: str) -> str:
    data = {"weights": weights_digest, "text": text_sha, "tokens": n_tokens, "window": window,
            "tokenizer": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
            "version": REFERENCE_VERSION}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _cache_file(ckpt, ids: list[int], window: int, text_sha: str) -> Path:
    """Where the reference result of these tokens on this checkpoint is cached."""
    weights = ckpt.weights_digest
    if ckpt.config.longrope is not None:   # the same weights give two models (for_max_seq_len)
        weights += ":longrope-" + ("long" if ckpt.config.longrope.long else "short")
    key = reference_key(weights, text_sha, len(ids), window, ckpt.tokenizer_json)
    return cache_dir() / f"{key}.json"


def reference(ckpt, ids: list[int], window: int, text_sha: str,
              model: Optional[torch.nn.Module] = None, progress=None
              ) -> tuple[racc.EvalResult, bool]:
    """The unquantized (eager fp32) result on ids, from the cache or computed; (result, cached).

    `model`: an fp32 model of ckpt not yet quantized (used as it is at hand); without one
    the reference runs layer by layer (builder/layerwise_reference.py: one layer's fp32
    weights at a time), or loads the whole fp32 model for a family it does not split."""
    path = _cache_file(ckpt, ids, window, text_sha)
    try:
        d = json.loads(path.read_text())
        return racc.EvalResult(d["nll_sum"], d["count"], d["top1"]), True
    except (OSError, ValueError, KeyError):
        pass
    if model is not None and next(model.parameters()).dtype == torch.float32:
        res = racc.evaluate(model, eager_layout(model, window), ids, window)
    elif layerwise.supported(ckpt.config):
        res = layerwise.evaluate_layerwise(ckpt, ids, window, progress=progress)
    else:
        from kiln.builder.sources import load_model

        model = load_model(ckpt, dtype=torch.float32).eval()
        res = racc.evaluate(model, eager_layout(model, window), ids, window)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ref.")
        with os.fdopen(fd, "w") as f:
            json.dump({"nll_sum": res.nll_sum, "count": res.count, "top1": res.top1,
                       "ppl": res.ppl}, f)
        os.replace(tmp, path)
    except OSError:     # an unwritable cache (a full disk) only costs time; no partial file
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return res, False


class Gate:
    """The evaluation tokens of one build and its reference result."""

    def __init__(self, spec, ckpt):
        self.spec = spec
        self.text_name = "pydoc"
        text = racc.eval_text(self.text_name)
        self.text_sha = racc.sha256_text(text)
        self.window = racc.window_size(spec.limits.max_num_tokens, spec.limits.max_seq_len)
        n = eval_tokens_for(spec.accuracy, ckpt.config.num_parameters)
        all_ids = racc.eval_ids(encoder(ckpt.tokenizer_json), text, n)
        self.ids = all_ids
        self.ckpt = ckpt
        self.ref: Optional[racc.EvalResult] = None
        self.ref_cached = False

    def reference_cached(self) -> bool:
        """Whether the reference is in the cache (computing it needs the float32 model)."""
        return _cache_file(self.ckpt, self.ids, self.window, self.text_sha).is_file()

    def reference_how(self, model=None) -> str:
        """How compute_reference(model) gets the reference (the build's stage name)."""
        if self.reference_cached():
            return "cached"
        if model is not None and next(model.parameters()).dtype == torch.float32:
            return "eager fp32 model"
        if layerwise.supported(self.ckpt.config):
            return "fp32, one layer at a time"
        return "eager fp32 model (loaded whole: this family is not split by layer)"

    def compute_reference(self, model=None, progress=None) -> None:
        self.ref, self.ref_cached = reference(self.ckpt, self.ids, self.window, self.text_sha,
                                              model, progress)

    def run(self, step_fn, kv_dtype: str, plan_dir: Path) -> GateScore:
        """Measure the compiled plan against the reference; writes the reference's top-1
        predictions into plan_dir (verify re-runs the gate against them)."""
        spec = self.spec
        if self.ref is None:
            self.compute_reference()
        cfg = self.ckpt.config
        layout = racc.eval_layout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.window,
                                  spec.kv_cache.tokens_per_block, kv_dtype)
        res = racc.evaluate(step_fn, layout, self.ids, self.window)
        racc.write_top1(plan_dir / racc.REFERENCE_FILE, self.ref.top1)
        return racc.score(res, self.ref.ppl, self.ref.top1, spec.max_ppl_increase)

    def record(self, score: GateScore) -> AccuracyRecord:
        """The manifest's record of a passed gate: the score and how it was measured."""
        return AccuracyRecord(
            **dataclasses.asdict(score), text=self.text_name, text_sha256=self.text_sha,
            eval_tokens=len(self.ids), ids_sha256=racc.sha256_ids(self.ids),
            window=self.window, method=f"windows of {self.window} tokens, each a fresh sequence",
            reference="eager fp32 model of the same checkpoint",
            reference_top1=racc.REFERENCE_FILE, reference_cached=self.ref_cached)


def gate_message(score: GateScore, name: str, weights: str, kv_cache: str = "fp32"
                 ) -> Optional[str]:
    """None when the gate passes, else the build's error message."""
    if score.passed:
        return None
    what = f"{weights} weights" + (f", {kv_cache} KV cache" if kv_cache in kv_format.QUANTIZED
                                   else "")
    return (f"accuracy gate failed for {name} ({what}): perplexity "
            f"{score.ppl:.3f} vs {score.ref_ppl:.3f} unquantized is "
            f"{score.ppl_increase:+.2%}, above accuracy.max_ppl_increase "
            f"{score.max_ppl_increase:.2%} (top-1 agreement {score.top1_agreement:.2%} on "
            f"{score.tokens} tokens); no plan was written. Use a higher precision, AWQ "
            "calibration (accuracy.calibration_text: pydoc) for int4, a smaller "
            "precision.group_size, a bf16 precision.kv_cache, or raise "
            "accuracy.max_ppl_increase")


def calibration_runner(spec, ckpt) -> Callable[[torch.nn.Module], None]:
    """run(model) for AWQ: the eager model over calibration text (`pydoc`: the tokens right
    after the evaluation tokens, so calibration never sees the evaluation windows)."""
    name = spec.accuracy.calibration_text
    enc = encoder(ckpt.tokenizer_json)
    if name == "pydoc":
        ids = enc(racc.eval_text("pydoc"))
        start = eval_tokens_for(spec.accuracy, ckpt.config.num_parameters)
        ids = ids[start:start + CALIBRATION_TOKENS]
        if len(ids) < 64:
            ids = enc(racc.eval_text("pydoc"))[:CALIBRATION_TOKENS]
    else:
        ids = enc(name)[:CALIBRATION_TOKENS]
    window = racc.window_size(spec.limits.max_num_tokens, spec.limits.max_seq_len)

    def run(model):
        racc.evaluate(model, eager_layout(model, window, spec.kv_cache.tokens_per_block),
                      ids, window)
    return run
