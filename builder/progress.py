"""Build progress for a person at a terminal (stages with timings, a tensor counter).

On a terminal, counters redraw one line; elsewhere (CI logs) only stage lines are printed.
"""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._stage_t = self.t0
        self._stage = None

    def _write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()

    def _close_stage(self) -> None:
        if self._stage is not None:
            dt = time.perf_counter() - self._stage_t
            self._write(("\r\x1b[K" if self.tty else "") + f"  {self._stage} ({dt:.1f}s)\n")
        self._stage = None

    def stage(self, name: str) -> None:
        """Start a named stage (closing the previous one with its duration)."""
        self._close_stage()
        self._stage, self._stage_t = name, time.perf_counter()
        if self.tty:
            self._write(f"  {name} ...")

    def count(self, what: str, i: int, n: int) -> None:
        """A counter inside the current stage (e.g. tensors loaded), redrawn on a terminal."""
        if self.tty and (i == n or i % 8 == 0):
            self._write(f"\r\x1b[K  {self._stage} ... {what} {i}/{n}")

    def done(self, message: str) -> None:
        self._close_stage()
        self._write(f"{message} in {time.perf_counter() - self.t0:.1f}s\n")
