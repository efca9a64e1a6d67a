"""The draft plan of a spec with `speculative: {method: draft, draft_plan: DIR or SPEC}`.

draft_plan names a built plan directory, or a spec file (.yaml/.yml): then the draft's plan is
that spec's, built first at its default output (kiln build) or found in the store (kiln ci). A
draft spec drafts alone: one that names a draft itself, or a cycle, is refused.

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

from kiln.builder.spec import Spec, SpecError, default_output, load_spec
from kiln.contracts import MANIFEST_FILE
from kiln.contracts.manifest import DraftRecord, PlanManifest, SpeculativeSection, TargetSection

FIELD = "speculative.draft_plan"


SPEC_SUFFIXES = (".yaml", ".yml")


def _named(spec: Spec, spec_path) -> Optional[Path]:
    sp = spec.speculative
    if sp is None or sp.draft_plan is None:
        return None
    path = Path(os.path.expanduser(sp.draft_plan))
    return path if path.is_absolute() else Path(spec_path).resolve().parent / path


def draft_spec_path(spec: Spec, spec_path) -> Optional[Path]:
    """The draft's spec file when draft_plan names one (relative paths are the spec file's)."""
    path = _named(spec, spec_path)
    return path.resolve() if path is not None and path.suffix in SPEC_SUFFIXES else None


def load_draft_spec(spec: Spec, spec_path) -> Optional[tuple[Path, Spec]]:
    """(path, spec) of the draft spec draft_plan names; None when it names a plan directory or
    nothing. SpecError when the draft spec does not load, is this spec, or names a draft itself
    (a cycle included): a draft spec drafts alone."""
    path = draft_spec_path(spec, spec_path)
    if path is None:
        return None
    here = Path(spec_path).resolve()
    if path == here:
        raise SpecError(spec.name, [(FIELD, f"{path} is this spec itself: a spec cannot be "
                                     "its own draft")])
    try:
        draft = load_spec(path)
    except SpecError as e:
        raise SpecError(spec.name, [(FIELD, f"the draft spec does not load: {e}")]) from None
    if draft.speculative is not None and draft.speculative.draft_plan is not None:
        back = draft_spec_path(draft, path)
        why = (f"a cycle: {here.name} drafts with {path.name}, which drafts with {here.name}"
               if back == here else f"the draft spec {path} names a draft itself "
               f"({draft.speculative.draft_plan}); a draft spec must draft alone")
        raise SpecError(spec.name, [(FIELD, why)])
    return path, draft


def draft_dir(spec: Spec, spec_path, plan: Optional[Path] = None) -> Optional[Path]:
    """The draft plan's directory, None without one: `plan` when given (the built plan of a
    draft spec), the draft spec's default output (plans/NAME), or the directory named."""
    path = _named(spec, spec_path)
    if path is None:
        return None
    if plan is not None:
        return Path(plan)
    if (named := load_draft_spec(spec, spec_path)) is not None:
        return default_output(named[1])
    return path


def check_draft(spec: Spec, spec_path, ckpt, target: TargetSection,
                out: Path, plan: Optional[Path] = None) -> Optional[DraftRecord]:
    """Load and check the spec's draft plan (`plan`: see draft_dir) against the plan being
    built -> what the manifest records of it (None: no draft). SpecError names each
    difference."""
    path = draft_dir(spec, spec_path, plan)
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
                       path=os.path.relpath(os.path.abspath(path), os.path.abspath(out)))


def draft_now(spec: Spec, spec_path, plan: Optional[Path] = None) -> Optional[DraftRecord]:
    """The spec's draft plan (`plan`: see draft_dir) as it is now, read without loading it
    (kiln ci's assessment fingerprints a spec this way); None without one. SpecError when it
    is not a plan."""
    path = draft_dir(spec, spec_path, plan)
    if path is None:
        return None
    try:
        m = PlanManifest.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as e:
        raise SpecError(spec.name, [(FIELD, f"{path} is not a readable plan: {e}")]) from None
    return DraftRecord(name=m.name, fingerprint=m.fingerprint, path=str(path))


def draft_current(spec: Spec, spec_path, manifest: PlanManifest,
                  plan: Optional[Path] = None) -> bool:
    """Whether the draft plan a built plan recorded is still the spec's draft (`plan`: see
    draft_dir; torch-free: part of the quick up-to-date check). True for a spec without one."""
    path = draft_dir(spec, spec_path, plan)
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
