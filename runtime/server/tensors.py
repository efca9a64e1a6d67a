"""KServe v2 tensors on the wire: decode a ModelInferRequest's inputs, encode outputs.

Inputs arrive either all in `raw_input_contents` (one bytes entry per input, in order; what
Triton's clients send) or each in its typed `contents`. Raw numbers are little-endian; a raw
BYTES tensor is its elements one after another, each a little-endian uint32 length followed
by that many bytes:

    | len0 (u32 LE) | bytes0 ... | len1 (u32 LE) | bytes1 ... |

Outputs always travel in `raw_output_contents`, one entry per output (Triton's C++ client
reads raw_output_contents[i] for every output i without checking).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kiln.runtime.server.errors import invalid

# datatype -> (numpy dtype for raw data, InferTensorContents field, struct format of one
# little-endian element)
DATATYPES = {
    "BOOL": ("|b1", "bool_contents", "?"),
    "INT8": ("<i1", "int_contents", "b"), "INT16": ("<i2", "int_contents", "h"),
    "INT32": ("<i4", "int_contents", "i"), "INT64": ("<i8", "int64_contents", "q"),
    "UINT8": ("<u1", "uint_contents", "B"), "UINT16": ("<u2", "uint_contents", "H"),
    "UINT32": ("<u4", "uint_contents", "I"), "UINT64": ("<u8", "uint64_contents", "Q"),
    "FP16": ("<f2", None, "e"), "FP32": ("<f4", "fp32_contents", "f"),
    "FP64": ("<f8", "fp64_contents", "d"),
    "BYTES": (None, "bytes_contents", None),
}


@dataclass
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    values: list           # flattened elements: bool / int / float / bytes


def decode_inputs(request) -> dict[str, Tensor]:
    """The request's input tensors by name. Raises ServiceError (INVALID_ARGUMENT)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} "
                      "inputs: when used, it must hold one entry per input")
    out: dict[str, Tensor] = {}
    for i, t in enumerate(request.inputs):
        if t.name in out:
            raise invalid(f"input {t.name!r} is given twice")
        if t.datatype not in DATATYPES:
            raise invalid(f"input {t.name!r} has unknown datatype {t.datatype!r}; KServe v2 "
                          f"datatypes: {', '.join(DATATYPES)}")
        if any(d < 0 for d in t.shape):
            raise invalid(f"input {t.name!r} has shape {list(t.shape)}: dimensions must be >= 0")
        n = math.prod(t.shape)
        values = _raw_values(t, raw[i], n) if raw else _typed_values(t, n)
        out[t.name] = Tensor(t.name, t.datatype, tuple(t.shape), values)
    return out


def _raw_values(t, data: bytes, n: int) -> list:
    if t.datatype == "BYTES":
        values, pos = [], 0
        while pos < len(data):
            if len(values) == n:        # never decode more elements than the shape has
                raise invalid(f"input {t.name!r}: shape {list(t.shape)} has {n} elements, "
                              "the data holds more")
            if pos + 4 > len(data):
                raise invalid(f"input {t.name!r}: a raw BYTES element is cut short (each is a "
                              "4-byte little-endian length followed by the bytes)")
            (size,) = struct.unpack_from("<I", data, pos)
            if pos + 4 + size > len(data):
                raise invalid(f"input {t.name!r}: a raw BYTES element claims {size} bytes but "
                              f"only {len(data) - pos - 4} follow")
            values.append(bytes(data[pos + 4:pos + 4 + size]))
            pos += 4 + size
    else:
        dtype = np.dtype(DATATYPES[t.datatype][0])
        if len(data) != n * dtype.itemsize:
            raise invalid(f"input {t.name!r}: shape {list(t.shape)} of {t.datatype} needs "
                          f"{n * dtype.itemsize} raw bytes, got {len(data)}")
        values = np.frombuffer(data, dtype=dtype).tolist()
    if len(values) != n:
        raise invalid(f"input {t.name!r}: shape {list(t.shape)} has {n} elements, the data "
                      f"holds {len(values)}")
    return values


def _typed_values(t, n: int) -> list:
    field = DATATYPES[t.datatype][1]
    if field is None:
        raise invalid(f"input {t.name!r}: {t.datatype} can only be sent in raw_input_contents")
    values = getattr(t.contents, field)
    if len(values) != n:
        raise invalid(f"input {t.name!r}: shape {list(t.shape)} has {n} elements, "
                      f"contents.{field} holds {len(values)}")
    return list(values)


def encode_bytes(elements: Sequence[bytes]) -> bytes:
    """Raw form of a BYTES tensor."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def encode(datatype: str, values: Sequence) -> bytes:
    """Raw form of a tensor's flattened elements (a streamed token's outputs are one element
    each: struct packs those without numpy's array round trip)."""
    if datatype == "BYTES":
        return encode_bytes(values)
    if len(values) <= 16:
        return struct.pack(f"<{len(values)}{DATATYPES[datatype][2]}", *values)
    return np.asarray(values, dtype=np.dtype(DATATYPES[datatype][0])).tobytes()
