"""Open-loop arrival schedules: constant, Poisson, or gamma-bursty inter-arrival gaps.

Gamma follows vLLM's `bench serve`: shape = burstiness, scale = 1 / (rate * burstiness), so the
mean rate is kept while burstiness < 1 clusters requests and burstiness = 1 is Poisson.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from fulcrum.errors import InvalidInput

ArrivalKind = Literal["constant", "poisson", "gamma"]
ARRIVAL_KINDS: tuple[ArrivalKind, ...] = ("constant", "poisson", "gamma")
_BLOCK = 4096  # gaps drawn per RNG call; drawing one at a time costs client CPU


def inter_arrival_s(
    kind: ArrivalKind,
    rate_per_s: float,
    num: int,
    rng: np.random.Generator,
    *,
    burstiness: float = 1.0,
) -> np.ndarray:
    """`num` gaps in seconds between successive sends at mean `rate_per_s`."""
    if rate_per_s <= 0:
        raise InvalidInput(f"request rate must be > 0, got {rate_per_s}")
    mean_s = 1.0 / rate_per_s
    if kind == "constant":
        return np.full(num, mean_s)
    if kind == "poisson":
        return rng.exponential(mean_s, num)
    if kind == "gamma":
        if burstiness <= 0:
            raise InvalidInput(f"burstiness must be > 0, got {burstiness}")
        return rng.gamma(burstiness, mean_s / burstiness, num)
    raise InvalidInput(f"unknown arrival kind {kind!r}; expected one of {ARRIVAL_KINDS}")


class Schedule:
    """Absolute send times from `start_s` on, drawn in blocks as the run consumes them."""

    def __init__(
        self,
        kind: ArrivalKind,
        rate_per_s: float,
        start_s: float,
        *,
        seed: int = 0,
        burstiness: float = 1.0,
    ) -> None:
        inter_arrival_s(kind, rate_per_s, 0, np.random.default_rng(), burstiness=burstiness)
        self.kind = kind
        self.rate_per_s = rate_per_s
        self.burstiness = burstiness
        self._rng = np.random.default_rng(seed)
        self._next_s = start_s
        self._gaps: list[float] = []

    def next_s(self) -> float:
        """The next scheduled send time."""
        if not self._gaps:
            gaps = inter_arrival_s(
                self.kind, self.rate_per_s, _BLOCK, self._rng, burstiness=self.burstiness
            )
            self._gaps = gaps[::-1].tolist()
        due_s = self._next_s
        self._next_s += self._gaps.pop()
        return due_s
