"""`kiln deploy PLAN --out DIR`: the Helm chart renders (helm's own library, offline), lints
clean, and every object validates strictly against the Kubernetes schemas; values that
cannot hold the plan and plans that fail their checksums are refused before any pod."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from kiln.runtime.tools.deploy import DeployError, plan_sizing, verified_manifest, write_chart

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[2]
KUBE = "1.35.0"
ALL_ON = {"kserve": {"enabled": True}, "openai": {"enabled": True},
          "autoscaling": {"hpa": {"enabled": False}, "keda": {"enabled": True}},
          "plan": {"image": "registry.example/plans/tiny@sha256:" + "0" * 64,
                   "digest": "a" * 64}}


def render(chart, values=None) -> dict[str, dict]:
    """kind -> the rendered object (one of each kind in this chart)."""
    out = {}
    for text in helm.Chart.load(str(chart)).render(values or {}, name="rel",
                                                   namespace="ns").values():
        for doc in yaml.safe_load_all(text):
            if doc:
                assert doc["kind"] not in out
                out[doc["kind"]] = doc
    return out


@pytest.fixture(scope="module")
def chart(tiny_plan, tmp_path_factory):
    return write_chart(tiny_plan, tmp_path_factory.mktemp("chart"))


def test_chart_lints_and_every_object_validates(chart):
    report = helm.lint(str(chart), strict=True)
    assert report["errors"] == [] and report["messages"] == [], report
    seen = set()
    for values in ({}, ALL_ON):
        for kind, obj in render(chart, values).items():
            seen.add(kind)
            if obj["apiVersion"].split("/")[0] in ("keda.sh", "serving.kserve.io"):
                continue    # custom resources: their projects' models, below
            kv.validate(obj, KUBE, strict=True)
    assert seen == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                    "ScaledObject", "ServingRuntime", "InferenceService"}


def test_pod_is_sized_and_probed_from_the_plan(chart, tiny_plan):
    sizing = plan_sizing(verified_manifest(tiny_plan))
    objs = render(chart)
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["command"] == ["kiln"] and c["args"][:2] == ["serve", "/models/tiny-random"]
    threads = [a for a in c["args"] if a.startswith("--threads=")]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert threads == [f"--threads={env['OMP_NUM_THREADS']}"]
    assert c["resources"]["limits"]["cpu"] == env["OMP_NUM_THREADS"]
    assert int(c["resources"]["limits"]["memory"]) >= sizing.floor_bytes
    start, live = c["startupProbe"], c["livenessProbe"]
    assert start["grpc"]["port"] == live["grpc"]["port"] == 8001
    assert start["periodSeconds"] * start["failureThreshold"] >= sizing.startup_seconds
    drain = int(next(a for a in c["args"] if a.startswith("--drain-seconds=")).split("=")[1])
    assert live["periodSeconds"] * live["failureThreshold"] > drain    # never cuts a drain
    assert pod["terminationGracePeriodSeconds"] > drain
    assert c["readinessProbe"]["grpc"]["service"] == "inference.GRPCInferenceService"
    [grpc_port] = [p for p in objs["Service"]["spec"]["ports"] if p["port"] == 8001]
    assert grpc_port["name"] == "h2c" and grpc_port["appProtocol"] == "kubernetes.io/h2c"
    hpa = objs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]
    assert hpa["metric"]["name"] == "kiln_queue_length"


def test_kserve_runtime_and_oci_plan_volume(chart):
    objs = render(chart, ALL_ON)
    runtime = objs["ServingRuntime"]["spec"]
    assert runtime["supportedModelFormats"][0]["name"] == "kiln-plan"
    assert runtime["protocolVersions"] == ["v2", "grpc-v2"]
    isvc = objs["InferenceService"]["spec"]["predictor"]["model"]
    assert isvc["modelFormat"]["name"] == "kiln-plan" and isvc["runtime"] == "rel-tiny-random"
    assert "triggers" in objs["ScaledObject"]["spec"]
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["image"]["reference"] == ALL_ON["plan"]["image"]
    assert "--expect-digest=" + "a" * 64 in pod["containers"][0]["args"]
    assert pod["containers"][0]["args"][1] == "/oci/models/tiny-random"


def test_kserve_and_keda_objects_validate_against_their_models(chart, tmp_path):
    """ServingRuntime and InferenceService against the `kserve` package's models, the KEDA
    ScaledObject against the models generated from KEDA's CRD schema (tests/crd_models.py,
    in a process of its own: unknown fields, wrong types and missing required fields are
    errors)."""
    if importlib.util.find_spec("kserve") is None:   # not imported here: its protos clash
        pytest.skip("pip install kserve (not in setup.sh: it installs slowly, with pandas "
                    "and the kubernetes client)")
    pytest.importorskip("cloudcoil.models.keda")
    objs = render(chart, ALL_ON)
    keda_typo = yaml.safe_load(yaml.safe_dump(objs["ScaledObject"]))
    keda_typo["spec"]["triggers"][0]["metdata"] = {"query": "up"}   # a field the CRD lacks
    no_name = yaml.safe_load(yaml.safe_dump(objs["ServingRuntime"]))
    del no_name["spec"]["containers"][0]["name"]
    docs = [objs["ServingRuntime"], objs["InferenceService"], objs["ScaledObject"],
            keda_typo, no_name]
    (tmp_path / "objects.yaml").write_text(yaml.safe_dump_all(docs))
    r = subprocess.run([sys.executable, "-m", "tests.crd_models", str(tmp_path / "objects.yaml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:3] == ["ok ServingRuntime", "ok InferenceService", "ok ScaledObject"], lines
    assert lines[3].startswith("error ScaledObject: ScaledObject.spec.triggers[0].metdata")
    assert lines[4].startswith("error ServingRuntime: ServingRuntime.spec.containers[0]")
    # KServe's modelcar reads the plan image from an oci:// storage URI
    isvc = objs["InferenceService"]["spec"]["predictor"]["model"]
    assert isvc["storageUri"] == "oci://" + ALL_ON["plan"]["image"]


def test_hpa_and_keda_together_fail_to_render(chart):
    with pytest.raises(helm.HelmError, match="not both"):
        render(chart, {"autoscaling": {"keda": {"enabled": True}}})


def test_memory_below_weights_and_kv_is_refused_with_the_arithmetic(tiny_plan, tmp_path):
    sizing = plan_sizing(verified_manifest(tiny_plan))
    values = tmp_path / "v.yaml"
    values.write_text(f"resources:\n  memory: {sizing.floor_bytes - 1}\n")
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "deploy", str(tiny_plan), "--out",
                        str(tmp_path / "out"), "--values", str(values)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert (f"weights {sizing.weights_bytes} + KV pool {sizing.kv_bytes} = "
            f"{sizing.floor_bytes} bytes") in r.stderr
    assert not (tmp_path / "out").exists()
    values.write_text("threads: 0\n")
    with pytest.raises(DeployError, match="threads"):
        write_chart(tiny_plan, tmp_path / "out", values)


def test_a_plan_failing_its_checksums_is_refused(tiny_plan, tmp_path):
    plan = shutil.copytree(tiny_plan, tmp_path / "plan")
    tok = plan / "tokenizer.json"
    tok.write_bytes(tok.read_bytes().replace(b"{", b"[", 1))
    with pytest.raises(DeployError, match="tokenizer.json does not match plan.json"):
        write_chart(plan, tmp_path / "out")


def test_rendered_container_serves_the_packaged_plan(tiny_plan, chart, tmp_path):
    """The Deployment's command, args and env, run as they are on loopback against the plan
    unpacked from its OCI image where the image volume puts it: the probes' gRPC health
    services report SERVING, and SIGTERM drains to exit 0."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc

    from tests.server_helpers import free_port
    from kiln.runtime.tools.package import package_plan, unpack_layout

    packaged = package_plan(tiny_plan, tmp_path / "oci")
    root = tmp_path / "image-volume"
    unpack_layout(tmp_path / "oci", root / "models" / packaged.name)
    ports = {"grpc": free_port(), "metrics": free_port(), "http": free_port()}
    objs = render(chart, {"plan": {"image": "registry.example/p@" + packaged.manifest.digest,
                                   "digest": packaged.plan_digest},
                          "ports": ports, "threads": 1})
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "plan"]
    args = [a.replace(mount["mountPath"], str(root), 1) if a.startswith(mount["mountPath"])
            else a for a in c["args"]]
    exe = shutil.which(c["command"][0], path=str(Path(sys.executable).parent))
    env = dict(os.environ, **{e["name"]: e["value"] for e in c["env"]})
    env["HOME"] = str(tmp_path)   # the pod's /tmp emptyDir
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([exe, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                service = c[probe]["grpc"]["service"]
                budget = c[probe]["periodSeconds"] * c[probe]["failureThreshold"]
                assert _wait_serving(stub, service, proc, max(budget, 120)), (
                    probe, (tmp_path / "serve.log").read_text()[-3000:])
        # the endpoint picker's metric names (values.yaml) are gauges the server exposes
        names = yaml.safe_load((chart / "values.yaml").read_text())["inferenceExtension"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics']}/metrics",
                                      timeout=10).read().decode()
        for metric in names.values():
            assert f"# TYPE {metric} gauge" in text, metric
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(pod["terminationGracePeriodSeconds"]) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _wait_serving(stub, service: str, proc, seconds: float) -> bool:
    from grpc_health.v1 import health_pb2
    import grpc

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    return False
