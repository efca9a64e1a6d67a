"""The engine's configuration: its limits and scheduler settings, read from a plan, which
may lower them at load and never raise them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kiln.contracts import FieldError, default_input_len
from kiln.plugins.inflight_batching import SchedulerConfig
from kiln.runtime.plan import Plan


@dataclass(frozen=True)
class EngineConfig(SchedulerConfig):
    """The engine's limits and scheduler settings (fields: see SchedulerConfig)."""

    @classmethod
    def from_plan(cls, plan: Plan, **overrides) -> "EngineConfig":
        """The plan's limits and scheduler section; limits (and the queue bound) may be
        lowered, never raised. FieldError names the setting; the values are then checked once,
        by SchedulerConfig."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise FieldError(unknown[0], "is not an engine setting",
                             f"unknown engine setting {unknown[0]!r}; settings: "
                             f"{', '.join(sorted(names))}")
        lim, scheduler = plan.limits, plan.manifest.scheduler
        values = dataclasses.asdict(lim)
        values["tokens_per_block"] = plan.manifest.kv_cache.tokens_per_block
        values.update(dataclasses.asdict(scheduler))
        # the manifest field each ceiling comes from
        planned = {k: f"limits.{k}" for k in dataclasses.asdict(lim)}
        planned["max_queue"] = "scheduler.max_queue"
        for k, v in overrides.items():
            if v is None:
                continue
            if k in planned and v > values[k]:
                problem = (f"{v} exceeds the plan's {planned[k]} ({values[k]}): limits may be "
                           f"lowered at load, never raised. Rebuild the plan with a higher "
                           f"{planned[k]}")
                raise FieldError(k, problem, f"{k}={v} exceeds the plan's {k} ({values[k]}): "
                                 f"limits may be lowered at load, never raised. Rebuild the "
                                 f"plan with a higher {planned[k]}")
            if k == "tokens_per_block" and v != values[k]:
                raise FieldError(k, f"{v}: the plan's KV layout has {values[k]}; it is fixed "
                                 "at build time", f"tokens_per_block={v}: the plan's KV layout "
                                 f"has {values[k]}; it is fixed at build time")
            values[k] = v
        if "max_input_len" not in overrides:   # follows a lowered max_seq_len
            values["max_input_len"] = min(values["max_input_len"],
                                          default_input_len(values["max_seq_len"]))
        return cls(**values)
