"""KServe v2 request decoding (no server): raw and typed contents, BYTES framing, the
TensorRT-LLM ensemble inputs and their refusals."""
from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as kpb

from kiln.runtime.server.errors import ServiceError
from kiln.runtime.server.kserve import parse, response
from kiln.runtime.server.limits import RequestLimits
from kiln.runtime.server.tensors import DATATYPES, decode_inputs, encode, encode_bytes

pytestmark = pytest.mark.unit


def req(raw=True, **tensors):
    """tensors: name=(datatype, shape, values)."""
    r = kpb.ModelInferRequest(model_name="m", id="7")
    for name, (dt, shape, values) in tensors.items():
        t = r.inputs.add(name=name, datatype=dt, shape=shape)
        if raw:
            if dt == "BYTES":
                r.raw_input_contents.append(encode_bytes(values))
            else:
                np_dt = {"INT32": "<i4", "FP32": "<f4", "BOOL": "?", "UINT64": "<u8"}[dt]
                r.raw_input_contents.append(np.asarray(values, np_dt).tobytes())
        else:
            field = {"BYTES": "bytes_contents", "INT32": "int_contents", "FP32": "fp32_contents",
                     "BOOL": "bool_contents", "UINT64": "uint64_contents"}[dt]
            getattr(t.contents, field).extend(values)
    return r


BASE = dict(text_input=("BYTES", [1, 1], [b"hello"]), max_tokens=("INT32", [1, 1], [5]))


@pytest.mark.parametrize("raw", [True, False])
def test_parse_maps_ensemble_inputs(raw):
    job = parse(req(raw, **BASE, stream=("BOOL", [1, 1], [True]),
                    temperature=("FP32", [1, 1], [0.5]), top_p=("FP32", [1, 1], [0.0]),
                    min_length=("INT32", [1, 1], [2]), random_seed=("UINT64", [1, 1], [2**63]),
                    end_id=("INT32", [1, 1], [3]), stop_words=("BYTES", [1, 2], [b"x", b"yz"]),
                    return_num_output_tokens=("BOOL", [1, 1], [True]),
                    ignore_eos=("BOOL", [1, 1], [True]),
                    return_log_probs=("BOOL", [1, 1], [False])), 100)
    p = job.params
    assert (job.id, job.prompt, job.stream, job.exclude_input) == ("7", "hello", True, False)
    # top_k and top_p 0: TensorRT-LLM's greedy search, the temperature notwithstanding
    assert (p.max_tokens, p.temperature, p.top_p, p.min_tokens, p.seed) == (5, 0.0, 1.0, 2, 2**63)
    assert p.stop == ("x", "yz") and p.stop_token_ids == (3,) and p.ignore_eos
    assert job.outputs == ["text_output", "num_output_tokens"]


@pytest.mark.parametrize("extra, temperature, top_k, top_p", [
    ({}, 0.0, 0, 1.0),                                                   # genai-perf's request
    (dict(temperature=("FP32", [1, 1], [0.7])), 0.0, 0, 1.0),
    (dict(top_k=("INT32", [1, 1], [0]), top_p=("FP32", [1, 1], [0.0])), 0.0, 0, 1.0),
    (dict(top_k=("INT32", [1, 1], [40])), 1.0, 40, 1.0),
    (dict(top_k=("INT32", [1, 1], [40]), temperature=("FP32", [1, 1], [0.7])), 0.7, 40, 1.0),
    (dict(top_p=("FP32", [1, 1], [0.9]), temperature=("FP32", [1, 1], [0.7])), 0.7, 0, 0.9),
    (dict(top_p=("FP32", [1, 1], [0.9]), temperature=("FP32", [1, 1], [0.0])), 0.0, 0, 0.9),
])
def test_parse_greedy_unless_top_k_or_top_p(extra, temperature, top_k, top_p):
    """TensorRT-LLM's defaults: a request that asks for neither top-k nor top-p sampling is
    decoded greedily, as Triton's TensorRT-LLM backend decodes it."""
    p = parse(req(**BASE, **extra), 100).params
    assert (p.temperature, p.top_k, p.top_p) == pytest.approx((temperature, top_k, top_p))


@pytest.mark.parametrize("tensors, reason", [
    (dict(BASE, foo=("INT32", [1, 1], [1])), "unknown input 'foo'"),
    (dict(text_input=BASE["text_input"]), "missing required input 'max_tokens'"),
    (dict(BASE, max_tokens=("FP32", [1, 1], [5.0])), "datatype FP32; expected INT32"),
    (dict(BASE, text_input=("BYTES", [1, 2], [b"a", b"b"])), "shape [1, 2]"),
    (dict(BASE, max_tokens=("INT32", [1, 1], [0])), "max_tokens = 0"),
    (dict(BASE, max_tokens=("INT32", [1, 1], [101])), "max_tokens = 101"),
    (dict(BASE, text_input=("BYTES", [1, 1], [b"\xff\xfe"])), "not valid UTF-8"),
    (dict(BASE, top_k=("INT32", [1, 1], [-5])), "top_k"),
    (dict(BASE, temperature=("FP32", [1, 1], [-1.0])), "temperature"),   # greedy or not
    (dict(BASE, return_log_probs=("BOOL", [1, 1], [True])), "not served"),
    (dict(BASE, beam_width=("INT32", [1, 1], [4])), "beam_width = 4"),
])
def test_parse_refusals(tensors, reason):
    with pytest.raises(ServiceError) as e:
        parse(req(**tensors), 100)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in e.value.message


def test_raw_framing_errors():
    r = req(**BASE)
    r.raw_input_contents[0] = struct.pack("<I", 10) + b"abc"   # claims 10 bytes, has 3
    with pytest.raises(ServiceError, match="claims 10 bytes"):
        decode_inputs(r)
    r = req(**BASE)
    r.raw_input_contents[1] = b"\x01\x00"                       # 2 bytes for an INT32
    with pytest.raises(ServiceError, match="needs 4 raw bytes"):
        decode_inputs(r)
    r = req(**BASE)
    del r.raw_input_contents[1]
    with pytest.raises(ServiceError, match="one entry per input"):
        decode_inputs(r)


def test_response_outputs_are_raw_and_flagged():
    job = parse(req(**BASE, return_num_input_tokens=("BOOL", [1, 1], [True])), 100)
    res = response(job, "m", "héllo", 3, 2, final=False)
    assert [o.name for o in res.outputs] == ["text_output", "num_input_tokens"]
    assert len(res.raw_output_contents) == 2 and list(res.outputs[0].shape) == [1, 1]
    assert res.raw_output_contents[0] == struct.pack("<I", 6) + "héllo".encode()
    assert np.frombuffer(res.raw_output_contents[1], "<i4").tolist() == [3]
    assert res.parameters["triton_final_response"].HasField("bool_param")
    assert res.parameters["triton_final_response"].bool_param is False


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d != "BYTES"])
def test_encode_short_and_long_tensors_as_numpy_does(datatype):
    """Short tensors (a streamed token's outputs) are packed with struct, long ones through
    numpy: the same little-endian bytes either way."""
    for n in (1, 3, 16, 17, 40):
        values = ([i % 2 == 0 for i in range(n)] if datatype == "BOOL"
                  else [i % 100 for i in range(n)])
        expected = np.asarray(values, dtype=np.dtype(DATATYPES[datatype][0])).tobytes()
        assert encode(datatype, values) == expected, (datatype, n)


def test_names_shapes_and_sizes_are_checked_before_any_element_is_decoded():
    """Inputs are vetted by their headers first: a tensor is refused for its name, shape,
    element count or byte size before its data is decoded (nor is more decoded than the
    shape holds)."""
    junk = struct.pack("<I", 0) * 100_000 + b"\x01"     # 100k empty elements, then a stub
    r = req(**BASE)
    r.inputs.add(name="junk", datatype="BYTES", shape=[1, 100_000])
    r.raw_input_contents.append(junk)
    with pytest.raises(ServiceError, match="unknown input 'junk'"):
        parse(r, 100)
    r = req(**BASE)
    r.inputs.add(name="stop_words", datatype="BYTES", shape=[1, 100_000])
    r.raw_input_contents.append(junk)
    with pytest.raises(ServiceError, match="stop_words has 100000 entries; at most 64"):
        parse(r, 100)
    r = req(**BASE)
    r.inputs.add(name="bad_words", datatype="BYTES", shape=[1, 2])
    r.raw_input_contents.append(junk)                    # far more than 2 elements
    with pytest.raises(ServiceError, match="bytes; at most"):
        parse(r, 100)
    r = req(**BASE, stop_words=("BYTES", [1, 2], [b"a", b"b", b"c"]))  # one more than shape
    with pytest.raises(ServiceError, match="holds more"):
        parse(r, 100)
    r = req(**dict(BASE, text_input=("BYTES", [1, 1], [b"x" * 5000])))
    with pytest.raises(ServiceError, match="'text_input' holds 5000 bytes; at most 4096"):
        parse(r, 100, RequestLimits(max_prompt_bytes=4096), 16)
    r = req(**dict(BASE, text_input=("BYTES", [1, 100_000], [b""] * 100_000)))
    with pytest.raises(ServiceError, match=r"shape \[1, 100000\]"):
        parse(r, 100)
