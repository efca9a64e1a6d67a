"""The draft plan of a spec with `speculative: {method: draft, draft_plan: DIR}`.

At build the draft plan is loaded and verified like any plan (runtime/plan.py load_plan) and
checked against the plan being built (runtime/draft_model.py draft_mismatches: tokenizer,
vocabulary, bos/eos, max_seq_len, max_batch_size, device and CPU features); a mismatch refuses
the build, naming what differs. The plan records the draft's name, fingerprint and directory
(relative to the plan's own); the draft's fingerprint is one of the plan's fingerprint inputs,
so a rebuilt draft rebuilds the plans it drafts for.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from kiln.builder.spec import Spec, SpecError
from kiln.contracts import MANIFEST_FILE
from kiln.contracts.manifest import DraftRecord, PlanManifest, SpeculativeSection, TargetSection

FIELD = "speculative.draft_plan"


def draft_dir(spec: Spec, spec_path) -> Optional[Path]:
    """The draft plan's directory (relative paths are the spec file's), None without one."""
    sp = spec.speculative
    if sp is None or sp.draft_plan is None:
        return None
    path = Path(os.path.expanduser(sp.draft_plan))
    return path if path.is_absolute() else Path(spec_path).resolve().parent / path


def check_draft(spec: Spec, spec_path, ckpt, target: TargetSection,
                out: Path) -> Optional[DraftRecord]:
    """Load and check the spec's draft plan against the plan being built -> what the manifest
    records of it (None: no draft). SpecError names each difference."""
    path = draft_dir(spec, spec_path)
    if path is None:
        return None
    from kiln.runtime.draft_model import DraftTarget, draft_mismatches
    from kiln.runtime.plan import PlanError, load_plan

    try:
        draft = load_plan(path)
    except PlanError as e:
        raise SpecError(spec.name, [(FIELD, f"the draft plan cannot be loaded: {e}")]) from None
    gen = ckpt.generation
    eos = gen.get("eos_token_ids", ())
    facts = DraftTarget(
        tokenizer_json=ckpt.tokenizer_json.encode(), vocab_size=ckpt.config.vocab_size,
        bos_token_id=gen.get("bos_token_id"),
        eos_token_ids=tuple([eos] if isinstance(eos, int) else eos or ()),
        max_seq_len=spec.limits.max_seq_len,
        max_batch=min(spec.speculative.max_batch, spec.limits.max_batch_size),
        device=target.device, arch=target.arch, cpu_features=tuple(target.cpu_features or ()),
        compute_capability=target.compute_capability)
    problems = draft_mismatches(facts, draft)
    if problems:
        raise SpecError(spec.name, [(FIELD, f"{path} ({draft.name}) cannot draft for this "
                                     f"plan: {p}") for p in problems])
    return DraftRecord(name=draft.name, fingerprint=draft.fingerprint,
                       path=os.path.relpath(path.resolve(), out.resolve()))


def draft_now(spec: Spec, spec_path) -> Optional[DraftRecord]:
    """The spec's draft plan as it is now, read without loading it (kiln ci's assessment
    fingerprints a spec this way); None without one. SpecError when it is not a plan."""
    path = draft_dir(spec, spec_path)
    if path is None:
        return None
    try:
        m = PlanManifest.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as e:
        raise SpecError(spec.name, [(FIELD, f"{path} is not a readable plan: {e}")]) from None
    return DraftRecord(name=m.name, fingerprint=m.fingerprint, path=str(path))


def draft_current(spec: Spec, spec_path, manifest: PlanManifest) -> bool:
    """Whether the draft plan a built plan recorded is still the spec's draft (torch-free:
    part of the quick up-to-date check). True for a spec without a draft."""
    path = draft_dir(spec, spec_path)
    if path is None:
        return True
    recorded = manifest.speculative.draft if manifest.speculative else None
    try:
        now = PlanManifest.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    return recorded is not None and now.fingerprint == recorded.fingerprint


def speculative_section(spec: Spec, draft: Optional[DraftRecord]) -> Optional[SpeculativeSection]:
    """The manifest's speculative section (None: the spec has none)."""
    if spec.speculative is None:
        return None
    values = spec.speculative.model_dump(mode="json")
    del values["draft_plan"]       # recorded as the draft's record, relative to the plan
    return SpeculativeSection(**values, draft=draft)
