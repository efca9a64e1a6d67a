"""Torch-free contracts and constants shared by `kiln` (the CLI), `builder`, `runtime` and
`plugins`: the plan manifest's type (kiln.contracts.manifest), what a plan check reports (the
accuracy gate's score, kiln verify's report: kiln.contracts.reports) and the facts each side
must agree on. Importing this package imports nothing but the standard library, so the
builder's quick up-to-date check and `kiln` commands that do not build stay fast.
"""
from __future__ import annotations

KILN_VERSION = "0.3.0"

# The plan directory format this kiln writes and reads. History:
# 1: kiln 0.1-0.2.
# 2: kv_cache.dtype may be int8/fp8 (pool rows of codes + a scale: plugins/paged_kv/kv_format)
#    and bf16 plans run the quant plugin's linear_bf16; a version-1 runtime could not run them.
# 3: target.isa is a kiln ISA level (plugins/isa.py) and target.cpu_features lists the CPU
#    features the compiled code needs (asked of the compiler at build); engine.kernel_paths.
# 4: a CPU aoti plan's weights are a file of their own (engine.weights), mapped at load and
#    given to the engine as its constants; the engine file holds code only.
PLAN_FORMAT_VERSION = 4

# The manifest's file name inside a plan directory.
MANIFEST_FILE = "plan.json"


class FieldError(ValueError):
    """A bad value of one named setting, the setting carried as data.

    field: its name or path (`max_queue`, `precision.group_size`, `temperature`); problem:
    what is wrong, without the name, so a caller can report it in its own terms (a CLI flag,
    a spec path, an API input) without parsing the message. str(e): `message`, by default
    "<field> <problem>"."""

    def __init__(self, field: str, problem: str, message: str | None = None):
        self.field, self.problem = field, problem
        super().__init__(message or f"{field} {problem}")


def default_input_len(max_seq_len: int) -> int:
    """Prompt tokens allowed when a spec or config sets no max_input_len: room for one
    output token."""
    return max_seq_len - 1
