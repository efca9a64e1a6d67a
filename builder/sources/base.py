"""The Checkpoint object every source returns, and its error type."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Union

import torch

from kiln.builder.arch.config import DecoderConfig


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the file and the tensor/problem."""


@dataclass
class Checkpoint:
    config: DecoderConfig
    tokenizer_json: str          # a complete HF `tokenizers` JSON (tokenizer.json content)
    generation: dict             # bos_token_id, eos_token_ids [..], chat_template (str|None),
    #                              pad_token_id, add_bos_token (True when the tokenizer.json's
    #                              post-processor puts bos first on encode; never add it again)
    # sha256 hex of the source (see each source for what it covers), or the function that
    # computes it: hashing gigabytes waits until something asks (a build that is refused for
    # its memory never reads the weights)
    _weights_digest: Union[str, Callable[[], str]]
    source_desc: str             # "gguf /path (Q4_1)", "hf dir /path", "random seed 0"
    # dtype -> (our name, tensor) pairs, one at a time; set by the source.
    _stream: Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    # (dtype, names) -> the pairs of those names only, reading nothing else; None: the
    # source can only stream everything (random weights are drawn in order)
    _select: Optional[Callable[[torch.dtype, set], Iterator[tuple[str, torch.Tensor]]]] = \
        field(default=None, repr=False)

    @property
    def weights_digest(self) -> str:
        if callable(self._weights_digest):
            self._weights_digest = self._weights_digest()
        return self._weights_digest

    def tensors(self, dtype: Optional[torch.dtype] = torch.float32
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Our parameter names and tensors (already fused/unpermuted), streamed one at a time
        (dtype None: in the source's dtype, bf16 for most checkpoints)."""
        return self._stream(dtype)

    def tensors_of(self, names: set[str], dtype: torch.dtype = torch.float32
                   ) -> Optional[Iterator[tuple[str, torch.Tensor]]]:
        """Only the named tensors, read alone (None where the source cannot select)."""
        return None if self._select is None else self._select(dtype, set(names))


def build_mapped(plan: Iterable, read: Callable[[str], torch.Tensor], config: DecoderConfig,
                 where: object, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Our (name, tensor) pairs from a source's mapping plan (builder/arch/weights.py),
    one at a time; a transform's ValueError becomes a CheckpointError naming `where`."""
    for m in plan:
        try:
            t = m.build(read, config)
        except CheckpointError:
            raise
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        if dtype is not None:    # None: as the source holds it
            t = t.to(dtype)      # the source's copy (bf16 ...) goes now, not after the next one
        yield m.target, t
        del t                # before the next tensor is read
