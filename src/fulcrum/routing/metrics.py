"""The routing families on the service's registry, and the same counts for the statistics API:
per-arm requests, rows, errors and latency; shadow sent / dropped / failed and agreement; cascade
decisions and the first model's per-row scores. Series exist only for loaded models: `forget`
drops an unloaded model's."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

from fulcrum.metrics import LATENCY_BUCKETS_S
from fulcrum.stats import to_ns

UNIT_BUCKETS = tuple(round(0.05 * i, 2) for i in range(1, 21))  # agreement and scores in 0..1
# A generative answer's score: a mean or minimum token logprob (nats, <= 0)
LOGPROB_BUCKETS = (-8.0, -6.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.25, -1.0, -0.75, -0.5, -0.25,
                   -0.1, 0.0)  # fmt: skip


@dataclass(slots=True)
class ArmStats:
    """One A/B arm in the statistics API."""

    success: int = 0
    fail: int = 0
    rows: int = 0
    success_ns: int = 0  # total time of successful requests

    def to_json(self) -> dict[str, int]:
        return {"success": self.success, "fail": self.fail, "rows": self.rows,
                "success_ns": self.success_ns}  # fmt: skip


@dataclass(slots=True)
class ShadowStats:
    """One model's shadow traffic to its reference in the statistics API."""

    reference: str
    sent: int = 0
    dropped: int = 0
    failed: int = 0
    sampled: int = 0  # generations not shadowed: sampled, not greedy (their tokens differ)
    compared: int = 0  # shadows answered and compared
    agreement_sum: float = 0.0

    def to_json(self) -> dict[str, object]:
        mean = self.agreement_sum / self.compared if self.compared else None
        return {"reference": self.reference, "sent": self.sent, "dropped": self.dropped,
                "failed": self.failed, "sampled": self.sampled, "compared": self.compared,
                "agreement_mean": mean}  # fmt: skip


@dataclass(slots=True)
class ModelRouting:
    """A model's routing statistics."""

    arms: dict[str, ArmStats] = field(default_factory=dict)
    shadow: ShadowStats | None = None
    cascade: dict[str, int] = field(default_factory=dict)  # decision -> requests

    def to_json(self) -> dict[str, object]:
        row: dict[str, object] = {}
        if self.arms:
            row["ab"] = {arm: s.to_json() for arm, s in self.arms.items()}
        if self.shadow is not None:
            row["shadow"] = self.shadow.to_json()
        if self.cascade:
            row["cascade"] = dict(self.cascade)
        return row


class RoutingMetrics:
    """The A/B, shadow and cascade families, and each model's counts for `/v2/.../stats`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.arm_requests = Counter("fulcrum_ab_requests", "A/B requests by arm and outcome.",
                                    ("model", "arm", "outcome"), registry=r)  # fmt: skip
        self.arm_rows = Counter("fulcrum_ab_rows", "Rows answered by each A/B arm.",
                                ("model", "arm"), registry=r)  # fmt: skip
        self.arm_s = Histogram("fulcrum_ab_request_duration_seconds",
                               "Time of each A/B arm's successful requests.", ("model", "arm"),
                               buckets=LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self.shadows = Counter(
            "fulcrum_shadow_requests",
            "Shadow requests by outcome: sent, dropped (at max_in_flight or the reference full), "
            "failed (error or timeout), sampled (a sampled generation: not compared).",
            ("model", "reference", "outcome"), registry=r)  # fmt: skip
        self.agreement = Histogram(
            "fulcrum_shadow_agreement",
            "Agreement of each shadowed request with its reference (cosine, top-1 or exact).",
            ("model", "reference"), buckets=UNIT_BUCKETS, registry=r)  # fmt: skip
        self.cascade = Counter("fulcrum_cascade_decisions",
                               "Cascade requests answered by the first model or escalated.",
                               ("model", "then", "decision"), registry=r)  # fmt: skip
        self.scores = Histogram("fulcrum_cascade_score", "The first model's score of each row.",
                                ("model",), buckets=UNIT_BUCKETS, registry=r)  # fmt: skip
        self.logprob_scores = Histogram(
            "fulcrum_cascade_logprob_score",
            "A generative first model's score of each choice (mean or minimum token logprob).",
            ("model",), buckets=LOGPROB_BUCKETS, registry=r)  # fmt: skip
        self._models: dict[str, ModelRouting] = {}
        self._series: set[tuple[Counter | Histogram, tuple[str, ...]]] = set()

    def model(self, name: str) -> ModelRouting:
        found = self._models.get(name)
        if found is None:
            found = self._models[name] = ModelRouting()
        return found

    def stats_json(self, name: str) -> dict[str, object]:
        """The model's routing statistics ({} when it has none)."""
        found = self._models.get(name)
        return {} if found is None else found.to_json()

    def record_arm(self, model: str, arm: str, *, ok: bool, seconds: float, rows: int) -> None:
        stats = self.model(model).arms.setdefault(arm, ArmStats())
        self._inc(self.arm_requests, model, arm, "success" if ok else "failure")
        if not ok:
            stats.fail += 1
            return
        stats.success += 1
        stats.rows += rows
        stats.success_ns += to_ns(seconds)
        self._inc(self.arm_rows, model, arm, amount=rows)
        self._observe(self.arm_s, seconds, model, arm)

    def record_shadow(self, model: str, reference: str, outcome: str) -> None:
        """outcome: sent, dropped, failed or sampled."""
        stats = self._shadow(model, reference)
        setattr(stats, outcome, getattr(stats, outcome) + 1)
        self._inc(self.shadows, model, reference, outcome)

    def record_agreement(self, model: str, reference: str, agreement: float) -> None:
        stats = self._shadow(model, reference)
        stats.compared += 1
        stats.agreement_sum += agreement
        self._observe(self.agreement, agreement, model, reference)

    def record_cascade(
        self, model: str, then: str, decision: str, scores: list[float], *, logprobs: bool = False
    ) -> None:
        """One decision and its scores (`logprobs`: a generative model's, in nats)."""
        cascade = self.model(model).cascade
        cascade[decision] = cascade.get(decision, 0) + 1
        self._inc(self.cascade, model, then, decision)
        family = self.logprob_scores if logprobs else self.scores
        for score in scores:
            self._observe(family, score, model)

    def forget(self, model: str) -> None:
        """Drop an unloaded model's series and statistics."""
        self._models.pop(model, None)
        for family, labels in [x for x in self._series if x[1][0] == model]:
            self._series.discard((family, labels))
            family.remove(*labels)

    def _shadow(self, model: str, reference: str) -> ShadowStats:
        found = self.model(model)
        if found.shadow is None or found.shadow.reference != reference:
            found.shadow = ShadowStats(reference)
        return found.shadow

    def _inc(self, family: Counter, *labels: str, amount: float = 1) -> None:
        family.labels(*labels).inc(amount)
        self._series.add((family, labels))

    def _observe(self, family: Histogram, value: float, *labels: str) -> None:
        family.labels(*labels).observe(value)
        self._series.add((family, labels))
