"""Build progress for a person at a terminal (stages with timings, a tensor counter).

On a terminal the current stage's line is redrawn with its elapsed time (a compile runs for
minutes) and counters; elsewhere (CI logs) each stage prints one line when it ends. A stage's
closing line carries the builder's peak RSS so far (builder/memory.py), so the stage that set
the peak is the first whose figure reaches it, and the RSS at its end (what the stage left
held for the next).
"""
from __future__ import annotations

import sys
import threading
import time

from kiln.builder.memory import gib, peak_rss_bytes, rss_bytes


class Progress:
    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._stage_t = self.t0
        self._stage = None
        self._detail = ""
        self._lock = threading.Lock()
        self._ticker = None

    def _write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()

    def _redraw(self) -> None:
        with self._lock:
            if self._stage is not None:
                dt = time.perf_counter() - self._stage_t
                self._write(f"\r\x1b[K  {self._stage} ... {self._detail}{dt:.0f}s")

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            self._redraw()

    def _close_stage(self) -> None:
        if self._ticker is not None:
            self._ticker.set()
            self._ticker = None
        with self._lock:
            if self._stage is not None:
                dt = time.perf_counter() - self._stage_t
                now = rss_bytes()
                held = "" if now is None else f", {gib(now)} at its end"
                self._write(("\r\x1b[K" if self.tty else "")
                            + f"  {self._stage} ({dt:.1f}s, peak RSS {gib(peak_rss_bytes())}"
                            + f"{held})\n")
            self._stage, self._detail = None, ""

    def stage(self, name: str) -> None:
        """Start a named stage (closing the previous one with its duration)."""
        self._close_stage()
        self._stage, self._stage_t = name, time.perf_counter()
        if self.tty:
            self._ticker = threading.Event()
            threading.Thread(target=self._tick, args=(self._ticker,), daemon=True).start()
            self._redraw()

    def end_stage(self) -> None:
        """Close the current stage (its line with its duration) without starting another."""
        self._close_stage()

    def count(self, what: str, i: int, n: int) -> None:
        """A counter inside the current stage (e.g. tensors loaded), redrawn on a terminal."""
        if self.tty and (i == n or i % 8 == 0):
            self._detail = f"{what} {i}/{n} "
            self._redraw()

    def done(self, message: str) -> None:
        self._close_stage()
        self._write(f"{message} in {time.perf_counter() - self.t0:.1f}s "
                    f"(builder peak RSS {gib(peak_rss_bytes())})\n")
