"""Back-off strategies: one-method objects, so tests and simulations can swap them."""

from __future__ import annotations

import random
from typing import Protocol


class Backoff(Protocol):
    def compute(self, failures: int) -> float:
        """Seconds to wait before the next attempt after ``failures`` consecutive failures."""


class ExponentialBackoff:
    """``base * 2**(failures-1)``, capped, drawn between half and all of it ("equal jitter"),
    so retries of many branches spread out yet never come back sooner than half the delay."""

    def __init__(self, base: float = 0.5, cap: float = 60.0, jitter: bool = True) -> None:
        self.base, self.cap, self.jitter = base, cap, jitter

    def compute(self, failures: int) -> float:
        delay = min(self.cap, self.base * 2 ** max(0, failures - 1))
        return random.uniform(delay / 2, delay) if self.jitter else delay


class NoBackoff:
    def compute(self, failures: int) -> float:
        return 0.0
