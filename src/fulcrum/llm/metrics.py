"""The LLM engine's Prometheus metrics, with vLLM's meanings, on a registry passed in.

Latencies are histograms (so replicas aggregate); every series carries only the `model` and
`version` labels (plus `finished_reason` on the request counter), so request content never
creates a series. The metric families are created once per registry and shared by every LLM
model and version registered on it; `LLMMetrics.remove` drops one model version's series when
its engine stops, so unloads and new versions leave nothing behind. The token budget's series
(fulcrum.llm.budget) show the dial as the SLO controller holds it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
_REQUEST_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                      40.0, 50.0, 60.0, 120.0, 240.0)  # fmt: skip
PREFIX = "fulcrum_llm_"
_LABELS = ("model", "version", "variant")


class _Families:
    """Every LLM metric family of one registry, labelled by model and version."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, _LABELS, registry=registry, buckets=buckets)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, _LABELS, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, _LABELS, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.",
                         _TTFT_BUCKETS_S)  # fmt: skip
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.",
                        _TOKEN_BUCKETS_S)  # fmt: skip
        self.tpot = hist("time_per_output_token_seconds",
                         "Per request: (e2e - ttft) / (output tokens - 1).",
                         _TOKEN_BUCKETS_S)  # fmt: skip
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to the last output token.",
                        _REQUEST_BUCKETS_S)  # fmt: skip
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled step.",
                          _REQUEST_BUCKETS_S)  # fmt: skip
        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting (preempted included).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.preemptions = counter("num_preemptions", "Preemptions by recompute.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")  # fmt: skip
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated.")
        self.restarts = counter("engine_restarts", "Engine threads restarted after a crash.")
        self.token_budget = gauge("num_batched_tokens_budget",
                                  "Token budget of the next step (max_num_batched_tokens unless "
                                  "an SLO adapts it).")  # fmt: skip
        self.running_limit = gauge("max_num_seqs_limit",
                                   "Running-sequence limit of the next step.")  # fmt: skip
        self.step_predicted = gauge("step_time_predicted_seconds",
                                    "Step-time model's prediction of the last step.")  # fmt: skip
        self.step_observed = gauge("step_time_observed_seconds", "The last step's time.")
        # Speculative decoding (vLLM's spec_decode_* names); only engines that speculate count.
        self.spec_drafts = counter("spec_decode_num_drafts", "Sequence-steps verifying drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.")  # fmt: skip
        self.spec_acceptance_rate = gauge(
            "spec_decode_acceptance_rate", "Accepted / proposed draft tokens, cumulative."
        )
        self.spec_mean_acceptance_length = gauge(
            "spec_decode_mean_acceptance_length", "Tokens per verifying step (accepted + 1)."
        )
        self.shed = Counter(PREFIX + "requests_shed", "Requests refused with 503 by reason.",
                            [*_LABELS, "reason"], registry=registry)  # fmt: skip
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                               [*_LABELS, "finished_reason"], registry=registry)  # fmt: skip
        # Guarded by _families_lock: engines of each (model, version), and the finished_reason
        # values each created.
        self.num_users: dict[tuple[str, str, str], int] = {}
        self.reasons: dict[tuple[str, str, str], set[str]] = {}
        self.shed_reasons: dict[tuple[str, str, str], set[str]] = {}

    def per_model(self) -> tuple[Histogram | Gauge | Counter, ...]:
        """The families labelled by (model, version) only."""
        return (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.running, self.waiting,
                self.kv_usage, self.preemptions, self.prefix_queries, self.prefix_hits,
                self.prompt_tokens, self.generation_tokens, self.restarts, self.token_budget,
                self.running_limit, self.step_predicted, self.step_observed, self.spec_drafts,
                self.spec_draft_tokens, self.spec_accepted_tokens, self.spec_acceptance_rate,
                self.spec_mean_acceptance_length)  # fmt: skip


_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def _families_of(registry: CollectorRegistry) -> _Families:
    with _families_lock:
        families = _families.get(registry)
        if families is None:
            families = _families[registry] = _Families(registry)
        return families


class LLMMetrics:
    """Instruments of one model version's engine; safe to call from the engine thread."""

    def __init__(
        self, registry: CollectorRegistry, model: str, version: int = 1, variant: str = "default"
    ) -> None:
        f = self._families = _families_of(registry)
        labels = self._labels = (model, str(version), variant)
        with _families_lock:
            # Two engines of one version can overlap (a reload of the same version): the series
            # go when the last of them is removed.
            f.num_users[labels] = f.num_users.get(labels, 0) + 1
        self._removed = False
        self.ttft_s = f.ttft.labels(*labels)
        self.itl_s = f.itl.labels(*labels)
        self.tpot_s = f.tpot.labels(*labels)
        self.e2e_s = f.e2e.labels(*labels)
        self.queue_s = f.queue.labels(*labels)
        self.running = f.running.labels(*labels)
        self.waiting = f.waiting.labels(*labels)
        self.kv_usage = f.kv_usage.labels(*labels)
        self.preemptions = f.preemptions.labels(*labels)
        self.prefix_queries = f.prefix_queries.labels(*labels)
        self.prefix_hits = f.prefix_hits.labels(*labels)
        self.prompt_tokens = f.prompt_tokens.labels(*labels)
        self.generation_tokens = f.generation_tokens.labels(*labels)
        self.restarts = f.restarts.labels(*labels)
        self.token_budget = f.token_budget.labels(*labels)
        self.running_limit = f.running_limit.labels(*labels)
        self.step_predicted_s = f.step_predicted.labels(*labels)
        self.step_observed_s = f.step_observed.labels(*labels)
        self.spec_drafts = f.spec_drafts.labels(*labels)
        self.spec_draft_tokens = f.spec_draft_tokens.labels(*labels)
        self.spec_accepted_tokens = f.spec_accepted_tokens.labels(*labels)
        self.spec_acceptance_rate = f.spec_acceptance_rate.labels(*labels)
        self.spec_mean_acceptance_length = f.spec_mean_acceptance_length.labels(*labels)

    def request_finished(self, finish_reason: str) -> None:
        """Count one finished request (stop, length, abort or error)."""
        f = self._families
        with _families_lock:
            f.reasons.setdefault(self._labels, set()).add(finish_reason)
        f.success.labels(*self._labels, finish_reason).inc()

    def request_shed(self, reason: str) -> None:
        """Count one request refused at admission ("slo_ttft" or "queue_full")."""
        f = self._families
        with _families_lock:
            f.shed_reasons.setdefault(self._labels, set()).add(reason)
        f.shed.labels(*self._labels, reason).inc()

    def remove(self) -> None:
        """Drop this model version's series from the registry (its engine stopped for good);
        idempotent."""
        f = self._families
        with _families_lock:
            if self._removed:
                return
            self._removed = True
            f.num_users[self._labels] -= 1
            if f.num_users[self._labels] > 0:
                return
            del f.num_users[self._labels]
            reasons = f.reasons.pop(self._labels, set())
            shed_reasons = f.shed_reasons.pop(self._labels, set())
        for family in f.per_model():
            with contextlib.suppress(KeyError):
                family.remove(*self._labels)
        for reason in reasons:
            with contextlib.suppress(KeyError):
                f.success.remove(*self._labels, reason)
        for reason in shed_reasons:
            with contextlib.suppress(KeyError):
                f.shed.remove(*self._labels, reason)
