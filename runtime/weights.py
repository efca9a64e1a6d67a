"""A CPU plan's weights: one file beside the compiled engine, mapped, never copied.

    weights.bin  (engine.weights.file)
    +----------+---+----------+---+-----
    | tensor 0 |pad| tensor 1 |pad| ...     each at a multiple of ALIGN bytes; a tied weight
    +----------+---+----------+---+-----    (embedding = lm_head) is one region, named twice

engine.weights.tensors names each constant of the compiled engine (by its fully qualified
name in the exported model) with its byte offset, dtype, shape and strides. `map_weights` maps
the file read-only, hashes the mapping against the manifest's sha256 (one pass over the
mapped pages: no read into Python, no copy) and makes the tensors as views of the mapping. The
engine gets them as user-managed constants (plan.py): its weights are then the page cache's
pages, which every process serving the plan on the host shares, and a load costs about the
file's bytes in time (hash) and nothing in private memory.

The code files (engine, kernels) are still copied and hashed before they are loaded (plan.py
`verified_copy`): a mapped weight is data, and a weights file changed after the check can
change the logits, not what code runs.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import stat
import warnings
from pathlib import Path
from typing import Optional

import torch

from kiln.contracts.manifest import FileEntry, WeightsSection

ALIGN = 64   # bytes: each tensor starts on a cache line (vector loads)


class WeightsError(RuntimeError):
    """A weights file that does not match its manifest entry (plan.py turns it into a
    PlanError with the rebuild command)."""


def extent(shape, stride) -> int:
    """Elements a strided view spans from its first element (0 for an empty one)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


class MappedWeights:
    """The weights file mapped read-only and its tensors (views of the mapping).

    close(): unmaps the file; call it only once nothing can run on the tensors (the engine
    that holds them is closed): torch 2.13's runner never drops its reference to user-managed
    constants, so their release cannot be what frees the mapping."""

    def __init__(self, mapping: mmap.mmap, tensors: dict[str, torch.Tensor]):
        self.mapping = mapping
        self.tensors = tensors

    @property
    def nbytes(self) -> int:
        return len(self.mapping) if not self.mapping.closed else 0

    def close(self) -> None:
        self.tensors = {}
        if not self.mapping.closed:
            self.mapping.close()


def map_weights(path: Path, section: WeightsSection, expected: Optional[FileEntry]
                ) -> MappedWeights:
    """Map `path` (the plan's weights file), check it against `expected` (its size and
    sha256; None: a plan the builder is writing) and make the tensors `section` lists."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WeightsError(f"{path.name} is not a regular file")
        if expected is not None and st.st_size != expected.size:
            raise WeightsError(f"{path.name} is {st.st_size} bytes, the manifest says "
                               f"{expected.size}")
        if st.st_size == 0:
            raise WeightsError(f"{path.name} is empty")
        mapping = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        if expected is not None:
            mapping.madvise(mmap.MADV_SEQUENTIAL)
            if hashlib.sha256(mapping).hexdigest() != expected.sha256:
                raise WeightsError(f"{path.name} does not match its sha256 in the manifest "
                                   "(changed after the build)")
            mapping.madvise(mmap.MADV_NORMAL)
        return MappedWeights(mapping, _views(mapping, section, path))
    except BaseException:
        mapping.close()
        raise


def _views(mapping: mmap.mmap, section: WeightsSection, path: Path) -> dict[str, torch.Tensor]:
    """{fqn: the tensor over its bytes of the mapping}; WeightsError for an entry that does
    not fit the file."""
    with warnings.catch_warnings():   # the mapping is read-only on purpose: nothing writes
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
    tensors = {}
    for fqn, t in section.tensors.items():
        dtype = getattr(torch, t.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise WeightsError(f"{path.name}: {fqn} has an unknown dtype {t.dtype!r}")
        nbytes = extent(t.shape, t.stride) * dtype.itemsize
        if t.offset < 0 or t.offset % dtype.itemsize or t.offset + nbytes > len(mapping):
            raise WeightsError(f"{path.name}: {fqn} (bytes {t.offset}..{t.offset + nbytes}) "
                               f"is not a {t.dtype} range of the file ({len(mapping)} bytes)")
        if nbytes == 0:
            tensors[fqn] = torch.empty(t.shape, dtype=dtype)
            continue
        region = flat[t.offset:t.offset + nbytes].view(dtype)
        tensors[fqn] = region.as_strided(t.shape, t.stride)
    return tensors
