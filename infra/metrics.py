"""Throughput between two logging points, measured without synchronising every step."""

from __future__ import annotations

import time


class Throughput:
    """Counts tokens and steps since the last `rate()` call and divides by the wall time."""

    def __init__(self):
        self._start = time.perf_counter()
        self._tokens = 0
        self._steps = 0
        self._waited = 0.0

    def add(self, tokens: int, steps: int = 1) -> None:
        self._tokens += tokens
        self._steps += steps

    def waited(self, seconds: float) -> None:
        """Time the loop spent waiting for data (the share of the step the loader did not hide)."""
        self._waited += seconds

    def rate(self) -> dict[str, float]:
        """tokens/s, and seconds per step and of data wait per step, since the previous call; then starts a new window."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        steps = max(self._steps, 1)
        out = {"tokens_per_second": self._tokens / elapsed, "step_time": elapsed / steps, "data_wait": self._waited / steps}
        self._start, self._tokens, self._steps, self._waited = now, 0, 0, 0.0
        return out
