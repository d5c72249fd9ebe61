"""The metrics of N engine processes as one model's (`num_engine_processes > 1`): counters and
histograms add up as each process's relayed events are replayed; a gauge shows, over the live
processes, the sum of their last values (requests running and waiting, the step budgets) or
their mean (KV usage: every process has a pool of the same size; step times; speculation
rates)."""

from __future__ import annotations

import threading

from prometheus_client import Gauge

from fulcrum.llm.metrics import LLMMetrics

# Gauges that count something each process holds: the model's figure is their sum.
SUMMED_GAUGES = frozenset({"running", "waiting", "token_budget", "running_limit"})


class GaugeTable:
    """Each process's last value of each gauge; sets the model's gauge on every change."""

    def __init__(self, metrics: LLMMetrics, num_children: int) -> None:
        self.metrics = metrics
        self._values: list[dict[str, float]] = [{} for _ in range(num_children)]
        self._lock = threading.Lock()  # every process's reader thread sets gauges

    def set(self, child: int, name: str, value: float) -> None:
        with self._lock:
            self._values[child][name] = value
            self._publish(name)

    def clear(self, child: int) -> None:
        """The process is gone: it holds nothing now (its replacement publishes anew)."""
        with self._lock:
            names = list(self._values[child])
            self._values[child].clear()
            for name in names:
                self._publish(name)

    def value(self, name: str) -> float | None:
        """The model's figure now (None: no process has set it)."""
        with self._lock:
            return self._aggregate(name)

    def _publish(self, name: str) -> None:
        gauge = getattr(self.metrics, name)
        gauge.set(self._aggregate(name) or 0.0)

    def _aggregate(self, name: str) -> float | None:
        values = [v[name] for v in self._values if name in v]
        if not values:
            return None
        total = sum(values)
        return total if name in SUMMED_GAUGES else total / len(values)


class _ChildGauge:
    """A gauge of one process: its value goes to the table, which sets the model's."""

    __slots__ = ("_child", "_name", "_table")

    def __init__(self, table: GaugeTable, child: int, name: str) -> None:
        self._table, self._child, self._name = table, child, name

    def set(self, value: float) -> None:
        self._table.set(self._child, self._name, value)


class ChildMetrics(LLMMetrics):
    """The `LLMMetrics` one process's client replays into: the model's counters and histograms,
    and gauges that go through the table."""

    def __init__(self, metrics: LLMMetrics, table: GaugeTable, child: int) -> None:
        # No super().__init__: the model's metrics own the series; these only lead to them.
        self._model = metrics
        for name, instrument in vars(metrics).items():
            if name.startswith("_"):
                continue
            if isinstance(instrument, Gauge):
                setattr(self, name, _ChildGauge(table, child, name))
            else:
                setattr(self, name, instrument)

    def request_finished(self, finish_reason: str) -> None:
        self._model.request_finished(finish_reason)

    def request_shed(self, reason: str) -> None:
        self._model.request_shed(reason)

    def remove(self) -> None:
        """Nothing to remove: the model's metrics own the series."""
