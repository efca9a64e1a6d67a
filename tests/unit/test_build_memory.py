"""The builder's memory accounting: peak RSS in the build log, the estimate from shapes, the
refusal's arithmetic."""
import io
import subprocess
import sys

import pytest

from kiln.builder import memory
from kiln.builder.progress import Progress

pytestmark = pytest.mark.unit


def test_each_stage_line_carries_the_peak_rss_and_what_it_left_held():
    out = io.StringIO()
    p = Progress(stream=out)
    p.stage("loading weights")
    p.stage("quantizing")
    p.done("plan written")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("  loading weights (") and ", peak RSS " in lines[0]
    assert lines[1].startswith("  quantizing (") and lines[1].endswith(" GiB at its end)")
    held = float(lines[1].split(", ")[-1].split()[0])
    peak = float(lines[1].split("peak RSS ")[1].split()[0])
    assert 0.05 < held <= peak
    assert "builder peak RSS" in lines[2]


def test_peak_rss_grows_with_what_the_process_touches():
    # in a fresh process: in a whole-suite run this one's peak is already set by the builds
    # of earlier tests, and touching 256 MiB more would not raise it
    code = ("from kiln.builder import memory\n"
            "before = memory.peak_rss_bytes()\n"
            "block = bytearray(256 << 20)\n"      # zero pages: touch them so they are resident
            "for i in range(0, len(block), 4096):\n"
            "    block[i] = 1\n"
            "print(memory.peak_rss_bytes() - before)\n")
    grown = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                               text=True).stdout)
    assert grown >= 200 << 20, grown


@pytest.mark.parametrize("text,value", [("24GiB", 24 << 30), ("512MiB", 512 << 20),
                                        ("1.5GiB", int(1.5 * (1 << 30))), ("1000", 1000)])
def test_parse_bytes(text, value):
    assert memory.parse_bytes(text, "x") == value


@pytest.mark.parametrize("text", ["lots", "-1G", "0"])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="x="):
        memory.parse_bytes(text, "x")


def _llama_1b_config():
    from kiln.builder.arch.families import config_from_hf

    return config_from_hf({"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
                           "intermediate_size": 8192, "num_hidden_layers": 16,
                           "num_attention_heads": 32, "num_key_value_heads": 8,
                           "head_dim": 64, "max_position_embeddings": 131072,
                           "tie_word_embeddings": True})


def test_estimate_from_shapes_of_a_1b_model():
    cfg = _llama_1b_config()
    est = memory.estimate(cfg, "int4", ("lm_head",), "quantize")
    assert 1.23e9 < est.params < 1.25e9              # Llama-3.2-1B: 1.236 B
    assert est.fp32_bytes == 4 * est.params
    # W4A8: int4 linears with group scales (0.97 B params), int8 embedding (0.26 B)
    assert 0.8e9 < est.plan_bytes < 0.95e9
    assert est.largest_bytes == 128256 * 2048 * 4    # the embedding
    assert est.peak_bytes == memory.FIXED_BYTES + int(memory.WHOLE_FP32_FACTOR
                                                       * est.fp32_bytes)
    ref = memory.estimate(cfg, "int4", ("lm_head",), "reference")
    streamed = memory.estimate(cfg, "int4", ("lm_head",))
    assert streamed.plan_bytes == est.plan_bytes
    assert streamed.peak_bytes < ref.peak_bytes < est.peak_bytes
    assert "accuracy reference" in ref.why and "streamed load" in streamed.why


def test_refusal_gives_the_arithmetic():
    est = memory.estimate(_llama_1b_config(), "int4", (), "quantize")
    msg = memory.refusal(est, 2 << 30, "--max-memory")
    assert msg.startswith(f"this checkpoint is larger than this machine can build: needs "
                          f"~{memory.gib(est.peak_bytes)}")
    assert "1.24 B parameters, weights 4.60 GiB fp32, plan ~0.8" in msg
    assert "peak = 1.45 x fp32 (whole model loaded, then quantized) + 1.00 GiB fixed" in msg
    assert "2.00 GiB available (--max-memory)" in msg
    assert memory.refusal(est, est.peak_bytes, "x") is None
    assert memory.refusal(est, None, "x") is None


def test_env_sets_the_memory_the_build_may_use(monkeypatch):
    monkeypatch.setenv(memory.MAX_MEMORY_ENV, "3GiB")
    assert memory.max_memory_override(None) == 3 << 30
    assert memory.max_memory_override(5) == 5
    monkeypatch.setenv(memory.MAX_MEMORY_ENV, "much")
    with pytest.raises(ValueError, match="KILN_BUILD_MAX_MEMORY='much'"):
        memory.max_memory_override(None)


def _usage(free: int):
    from types import SimpleNamespace

    return lambda path: SimpleNamespace(total=1 << 40, used=(1 << 40) - free, free=free)


def test_disk_refusal_gives_the_arithmetic(tmp_path, monkeypatch):
    est = memory.estimate(_llama_1b_config(), "int4", ())
    need = memory.disk_need(est)
    assert est.plan_bytes < need < est.plan_bytes * 1.1 + (64 << 20)
    out = tmp_path / "plans" / "llama-1b"         # not there yet: its parent's disk counts
    monkeypatch.setattr("shutil.disk_usage", _usage(100 << 20))
    msg = memory.disk_refusal(est, out)
    assert msg == (f"the plan will not fit on the disk that holds {tmp_path}: it needs "
                   f"~{memory.gib(need)} (weights ~{memory.gib(est.plan_bytes)}, engine, "
                   "kernels and tokenizer) and 0.10 GiB is free. Free space there, or build "
                   "with --out on another disk")
    monkeypatch.setattr("shutil.disk_usage", _usage(need))
    assert memory.disk_refusal(est, out) is None


def test_disk_full_is_found_along_the_causes():
    import errno
    import os

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/plans/p/weights.bin")
    assert memory.disk_full(full) is full
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("writing the engine failed") from e
    except RuntimeError as e:
        assert memory.disk_full(e) is full
    quoted = RuntimeError("g++: fatal error: error writing to /tmp/x.o: No space left on device")
    assert memory.disk_full(quoted) is quoted
    assert memory.disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None
    assert memory.disk_full(OSError(errno.EACCES, "Permission denied")) is None
    assert memory.disk_full(ValueError("bad value")) is None
