"""Figures of many replicas as one deployment's: Triton statistics rows summed across replicas,
and the replicas' Prometheus text merged under a `replica` label so every histogram stays
aggregatable (`sum without (replica)`). Pure: no Ray here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"
# Row keys that identify a row (equal in every replica's copy) and the one that is a timestamp.
_KEYS = ("name", "version", "variant")
_PER_REPLICA = ("policy", "cache", "lone_session")  # state kept per replica, not summed
_LATEST = "last_inference"


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    """What one replica reports when asked: its statistics rows and its metrics text."""

    replica: str  # Serve's replica id
    model: str
    rows: list[dict[str, object]]  # Service.statistics(...)["model_stats"]
    metrics_text: str  # Prometheus exposition of the replica's registry


def sum_statistics(
    per_replica: Sequence[Sequence[Mapping[str, object]]],
) -> list[dict[str, object]]:
    """One row per (model, version, variant): counters and durations summed, batch sizes merged,
    the latest `last_inference`; state that does not add up (the batch policy's, the cache's,
    the lone session's) is kept per replica under `replicas`."""
    merged: dict[tuple[object, ...], dict[str, object]] = {}
    for index, rows in enumerate(per_replica):
        for row in rows:
            key = tuple(row.get(k) for k in _KEYS)
            own = {k: v for k, v in row.items() if k in _PER_REPLICA}
            counters = {k: v for k, v in row.items() if k not in own}
            if key not in merged:
                merged[key] = {**{k: _copy(v) for k, v in counters.items()}, "replicas": []}
            else:
                _add_into(merged[key], counters)
            replicas = merged[key]["replicas"]
            assert isinstance(replicas, list)
            replicas.append({"index": index, **own})
    return [merged[key] for key in sorted(merged, key=str)]


def _copy(value: object) -> object:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _add_into(total: dict[str, object], row: Mapping[str, object]) -> None:
    for key, value in row.items():
        have = total.get(key)
        if key == _LATEST and isinstance(value, int) and isinstance(have, int):
            total[key] = max(have, value)
        elif key == "batch_stats" and isinstance(value, list) and isinstance(have, list):
            total[key] = _merge_batches(have, value)
        elif isinstance(value, Mapping) and isinstance(have, dict):
            _add_into(have, value)
        elif _is_number(value) and _is_number(have):
            total[key] = have + value  # type: ignore[operator]
        elif key not in total:
            total[key] = _copy(value)


def _merge_batches(have: list[object], more: list[object]) -> list[object]:
    by_size: dict[object, dict[str, object]] = {}
    for entry in [*have, *more]:
        assert isinstance(entry, Mapping)
        size = entry.get("batch_size")
        if size in by_size:
            _add_into(by_size[size], {k: v for k, v in entry.items() if k != "batch_size"})
        else:
            copied = _copy(entry)
            assert isinstance(copied, dict)
            by_size[size] = copied
    return [by_size[size] for size in sorted(by_size, key=_size_key)]


def _size_key(size: object) -> tuple[int, str]:
    return (size, "") if isinstance(size, int) else (0, str(size))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """The replicas' Prometheus texts (replica id -> text) as one exposition: each sample keeps
    its labels and gains `replica`, so counters and histogram buckets of different replicas
    stay distinct series that a query sums (`sum without (replica)`)."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                labels = {**sample.labels, REPLICA_LABEL: replica}
                merged.samples.append(
                    Sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
                )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector that yields families built elsewhere."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families
