"""The engine's LoRA adapters: a registry of loaded adapters (load/unload by name, requests
count as users) and the assignment of the adapters of each step to the plan's slots.

    load(name, dir) --PEFT--> weights on the host (at most max_cpu_adapters kept while idle;
                              an evicted adapter is read again from its directory when used)
    step: adapters of the scheduled sequences (<= max_adapters_per_batch, the scheduler's
          promise) -> slots; an adapter already in a slot stays there, others replace the
          least recently used slots not needed this step (their weights copied in once)

An adapter that requests use cannot be unloaded (the unload is refused, naming how many use
it): a request always runs with the adapter it was admitted with.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence

import torch

from kiln.plugins.inflight_batching import RequestRefused
from kiln.runtime.lora_buffers import AdapterWeights, LoraBuffers
from kiln.runtime.lora_peft import AdapterError, load_peft


class UnknownAdapterError(RequestRefused):
    """A request names an adapter that is not loaded (never served by the base instead)."""


class AdapterRegistry:
    """Loaded adapters by name, and which one each slot of the step's buffers holds."""

    def __init__(self, buffers: LoraBuffers, num_layers: int, base_model: Optional[str] = None):
        self.buffers = buffers
        self.section = buffers.section
        self.num_layers = num_layers
        self.base_model = base_model
        self._lock = threading.Lock()
        self._paths: dict[str, Path] = {}
        self._weights: OrderedDict[str, AdapterWeights] = OrderedDict()   # LRU first
        self._users: dict[str, int] = {}
        self._requests: dict[str, int] = {}          # requests each adapter served (ever)
        self._slots: list[Optional[str]] = [None] * buffers.num_slots
        self._slot_used = [0] * buffers.num_slots      # step counter of each slot's last use
        self._steps = 0

    @classmethod
    def for_plan(cls, plan, executor) -> Optional["AdapterRegistry"]:
        """The registry of a plan built with lora (None for one without); adapters are
        checked against the plan's recorded base model where it has one."""
        if executor.lora is None:
            return None
        model = plan.manifest.model
        return cls(executor.lora, plan.shape.num_layers, model.source_path)

    @staticmethod
    def acquire_for(registry: Optional["AdapterRegistry"], name: str) -> None:
        """`registry.acquire(name)`; RequestRefused when the plan takes no adapters."""
        if registry is None:
            raise UnknownAdapterError(f"adapter {name!r}: this plan was built without lora "
                                      "and serves its base model only")
        registry.acquire(name)

    # ---- loading -------------------------------------------------------------------------------
    def load(self, name: str, path) -> AdapterWeights:
        """Read and check the adapter at `path` under `name`; AdapterError (ValueError) naming
        what is wrong, or a name already loaded."""
        if not isinstance(name, str) or not name:
            raise AdapterError("an adapter needs a non-empty name")
        with self._lock:
            if name in self._paths:
                raise AdapterError(f"adapter {name!r} is already loaded (unload it first)")
        weights = self._read(name, Path(path))
        with self._lock:
            if name in self._paths:
                raise AdapterError(f"adapter {name!r} is already loaded (unload it first)")
            self._paths[name] = Path(path)
            self._users[name] = 0
            self._keep(name, weights)
        return weights

    def unload(self, name: str) -> None:
        """Forget an adapter; refused (AdapterError) while requests use it."""
        with self._lock:
            if name not in self._paths:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded")
            if self._users[name]:
                raise AdapterError(f"adapter {name!r} is used by {self._users[name]} request(s); "
                                   "unload it once they finish")
            del self._paths[name], self._users[name]
            self._weights.pop(name, None)
            self._slots = [None if s == name else s for s in self._slots]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._paths)

    def _read(self, name: str, path: Path) -> AdapterWeights:
        return load_peft(path, name, self.section, self.num_layers, self.base_model)

    def _keep(self, name: str, weights: AdapterWeights) -> None:
        """Hold `name`'s weights (most recently used); drop idle ones past max_cpu_adapters."""
        self._weights[name] = weights
        self._weights.move_to_end(name)
        idle = [n for n in self._weights if not self._users.get(n) and n != name]
        while len(self._weights) > self.section.max_cpu_adapters and idle:
            self._weights.pop(idle.pop(0))

    # ---- requests ------------------------------------------------------------------------------
    def acquire(self, name: str) -> None:
        """A request will use `name`: UnknownAdapterError if it is not loaded; its weights are
        read again if they were dropped while idle."""
        with self._lock:
            if name not in self._paths:
                known = ", ".join(sorted(self._paths)) or "none"
                raise UnknownAdapterError(f"unknown adapter {name!r} (loaded: {known})")
            self._users[name] += 1
            self._requests[name] = self._requests.get(name, 0) + 1
            weights, path = self._weights.get(name), self._paths[name]
        if weights is None:
            try:
                weights = self._read(name, path)
            except AdapterError:
                self.release(name)
                raise
        with self._lock:
            self._keep(name, weights)

    def release(self, name: Optional[str]) -> None:
        """A request that used `name` is done."""
        if name is None:
            return
        with self._lock:
            if self._users.get(name):
                self._users[name] -= 1

    def stats(self) -> tuple[int, int, dict[str, int]]:
        """(adapters loaded, adapters requests use now, requests per adapter name so far)."""
        with self._lock:
            return (len(self._paths), sum(1 for n in self._users.values() if n),
                    dict(self._requests))

    # ---- steps ---------------------------------------------------------------------------------
    def token_slots(self, adapters: Sequence[Optional[str]], counts: Sequence[int]
                    ) -> torch.Tensor:
        """[T] slots of a step whose sequences use `adapters` (None: the base model) with
        `counts` tokens each; writes adapters into slots as needed."""
        with self._lock:
            self._steps += 1
            need = list(dict.fromkeys(a for a in adapters if a is not None))
            if len(need) > len(self._slots):
                raise RuntimeError(f"{len(need)} adapters in one step; the plan has "
                                   f"{len(self._slots)} slots (a scheduler bug)")
            slot_of = {a: i for i, a in enumerate(self._slots) if a in need}
            spare = sorted((i for i, a in enumerate(self._slots) if a not in slot_of),
                           key=lambda i: self._slot_used[i])
            for a in need:
                if a not in slot_of:
                    i = spare.pop(0)
                    self.buffers.write(i, self._weights[a])
                    self._slots[i], slot_of[a] = a, i
                self._slot_used[slot_of[a]] = self._steps
        seq_slots = [-1 if a is None else slot_of[a] for a in adapters]
        return self.buffers.token_slots(seq_slots, counts)
