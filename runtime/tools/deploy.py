"""`kiln deploy PLAN --out DIR [--values FILE]`: a Helm chart sized from the plan's manifest.

    plan dir --verify (checksums)--> DeploySizing (weights + KV pool + overhead, threads,
             startup and drain seconds) --values.yaml + templates/--> DIR/<name>/

The templates are fixed text (runtime/tools/chart_templates.py); what the plan decides goes
into values.yaml, so `helm install --set ...` can still change it, and `kiln deploy --values`
checks the same arithmetic the pod will meet: memory below the plan's weights + KV pool is
refused with the numbers. A plan whose files do not match plan.json is refused here, not in a
crash-looping pod.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from kiln.contracts import KILN_VERSION
from kiln.contracts.manifest import PlanManifest

OVERHEAD_BYTES = 1 << 30        # interpreter, torch, gRPC, tokenizer, step buffers
LOAD_BYTES_PER_SECOND = 50e6    # a slow volume: the startup probe's budget per plan byte
LOAD_BASE_SECONDS = 60          # process start, torch import, kernel load, first step
DEFAULT_THREADS = 2
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


class DeployError(RuntimeError):
    """A plan or values that cannot be deployed (the message says why, with the numbers)."""


@dataclass(frozen=True)
class DeploySizing:
    """What the plan needs of a pod."""

    weights_bytes: int      # every plan file (engine, kernels, data): loaded into memory
    kv_bytes: int           # the KV pool at its budget
    kv_note: str            # how kv_bytes was derived
    startup_seconds: int    # the startup probe's budget for loading the plan

    @property
    def floor_bytes(self) -> int:
        """Memory below which the plan cannot run: weights + KV pool."""
        return self.weights_bytes + self.kv_bytes


def parse_quantity(value: object, what: str) -> int:
    """A Kubernetes memory quantity ("3Gi", "2500M", 1073741824) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kMGT]i?|)\s*", str(value))
    if not m or m.group(2) not in _UNITS:
        raise DeployError(f"{what}: {value!r} is not a memory quantity (e.g. 4Gi, 4000M)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_sizing(manifest: PlanManifest) -> DeploySizing:
    """Weights, KV pool and startup time of a plan, from its manifest alone."""
    from kiln.plugins.paged_kv import kv_format

    weights = sum(f.size for f in manifest.files.values())
    kv = manifest.kv_cache
    shape = manifest.model.shape
    if kv.budget_bytes:
        kv_bytes, note = int(kv.budget_bytes), "kv_cache.memory (bytes)"
    else:    # a fraction of what the host has: size the pool that holds every sequence whole
        per_token = kv_format.bytes_per_token(kv.dtype, shape.num_layers, shape.num_kv_heads,
                                              shape.head_dim)
        tokens = manifest.limits.max_batch_size * manifest.limits.max_seq_len
        kv_bytes = per_token * tokens
        note = (f"kv_cache.memory is a fraction ({kv.budget_fraction}) of the memory the host "
                f"reports, not the pod's limit: sized here for max_batch_size x max_seq_len = "
                f"{tokens} tokens; build with a byte budget to pin it")
    startup = LOAD_BASE_SECONDS + math.ceil(weights / LOAD_BYTES_PER_SECOND)
    return DeploySizing(weights, kv_bytes, note, startup)


def default_values(manifest: PlanManifest, sizing: DeploySizing) -> dict:
    """values.yaml: every knob of the chart, set from the plan."""
    memory = sizing.floor_bytes + OVERHEAD_BYTES
    return {
        "image": {"repository": "kiln-server", "tag": KILN_VERSION, "pullPolicy": "IfNotPresent"},
        "replicas": 1,
        "modelName": manifest.name,
        "plan": {"name": manifest.name, "digest": "",
                 # where /models/<name> comes from: an OCI image (kiln package), or a PVC
                 "image": "", "pvc": "kiln-plans"},
        "ports": {"grpc": 8001, "metrics": 8002, "http": 8000},
        "openai": {"enabled": False},
        "threads": DEFAULT_THREADS,
        "resources": {"memory": str(memory)},
        "sizing": {"weightsBytes": sizing.weights_bytes, "kvBytes": sizing.kv_bytes,
                   "overheadBytes": OVERHEAD_BYTES},
        "probes": {"startupSeconds": sizing.startup_seconds, "periodSeconds": 5},
        "drainSeconds": 30,
        "podDisruptionBudget": {"minAvailable": 1},
        "autoscaling": {
            "minReplicas": 1, "maxReplicas": 4,
            # requests waiting to be scheduled, per pod (kiln_queue_length)
            "queueLengthTarget": max(1, manifest.limits.max_batch_size // 2),
            "hpa": {"enabled": True},
            "keda": {"enabled": False, "prometheusAddress":
                     "http://prometheus-operated.monitoring.svc:9090"},
        },
        "kserve": {"enabled": False},
        # the Gateway API Inference Extension's endpoint picker reads these metric names
        # (gauges: queued requests, running requests, KV-cache utilisation from 0 to 1)
        "inferenceExtension": {"queueMetric": "kiln_queue_length",
                               "runningMetric": "kiln_running_requests",
                               "kvCacheUsageMetric": "kiln_kv_cache_usage_ratio",
                               # a LoRA plan: running/waiting adapters and the most a step takes
                               **({"loraInfoMetric": "kiln_lora_requests_info"}
                                  if manifest.lora is not None else {})},
    }


def merge(base: dict, over: dict) -> dict:
    """`over` laid onto `base` (nested dicts merged, everything else replaced)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def check_fit(values: dict, sizing: DeploySizing) -> None:
    """Refuse values whose memory cannot hold the plan, or whose threads are not a count."""
    memory = parse_quantity(values["resources"]["memory"], "resources.memory")
    if memory < sizing.floor_bytes:
        raise DeployError(
            f"resources.memory {values['resources']['memory']} = {memory} bytes "
            f"({gib(memory)}) cannot hold the plan: weights {sizing.weights_bytes} + KV pool "
            f"{sizing.kv_bytes} = {sizing.floor_bytes} bytes ({gib(sizing.floor_bytes)}), "
            f"plus about {gib(OVERHEAD_BYTES)} for the runtime")
    threads = values.get("threads")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise DeployError(f"threads: {threads!r} is not a positive whole number of cores")


def verified_manifest(plan: Path) -> PlanManifest:
    """The plan's manifest after checking every file against plan.json (size and sha256); a
    plan that would not load is a DeployError here. The target is checked where it runs."""
    from kiln.runtime.plan import PlanError, read_manifest, sha256_file

    try:
        manifest = read_manifest(plan)
    except PlanError as e:
        raise DeployError(str(e)) from None
    for rel, entry in sorted(manifest.files.items()):
        f = plan / rel
        if not f.is_file() or f.stat().st_size != entry.size or sha256_file(f) != entry.sha256:
            raise DeployError(f"plan {plan}: {rel} does not match plan.json (missing, resized "
                              "or altered); rebuild the plan before deploying it")
    return manifest


def write_chart(plan: str | Path, out: str | Path, values_file: Optional[Path] = None) -> Path:
    """Write the Helm chart of `plan` to `out`/<plan name>/ and return that directory."""
    from kiln.runtime.tools.chart_templates import TEMPLATES, chart_yaml

    plan = Path(plan)
    manifest = verified_manifest(plan)
    sizing = plan_sizing(manifest)
    values = default_values(manifest, sizing)
    if values_file is not None:
        try:
            extra = yaml.safe_load(Path(values_file).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise DeployError(f"--values {values_file}: {e}") from None
        if not isinstance(extra, dict):
            raise DeployError(f"--values {values_file}: not a mapping of values")
        values = merge(values, extra)
    check_fit(values, sizing)
    chart = Path(out) / _chart_name(manifest.name)
    (chart / "templates").mkdir(parents=True, exist_ok=True)
    (chart / "Chart.yaml").write_text(chart_yaml(_chart_name(manifest.name), KILN_VERSION))
    header = (f"# Sized from plan {manifest.name} (fingerprint {manifest.fingerprint[:16]}):\n"
              f"# memory >= weights {sizing.weights_bytes} + KV {sizing.kv_bytes} bytes "
              f"({sizing.kv_note}) + overhead {OVERHEAD_BYTES}\n")
    (chart / "values.yaml").write_text(header + yaml.safe_dump(values, sort_keys=False))
    for name, text in TEMPLATES.items():
        (chart / "templates" / name).write_text(text)
    return chart


def _chart_name(name: str) -> str:
    """A DNS-1123 label from the plan's name (Helm chart and object names)."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40].strip("-")
    return label or "kiln"
