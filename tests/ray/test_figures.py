"""Statistics and metrics read the whole deployment: every replica's counters summed, every
replica's histograms present under a `replica` label."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray_cluster import Cluster, running_replicas

pytestmark = pytest.mark.ray
BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


def echo_count(cluster: Cluster) -> int:
    stats = httpx.get(f"{cluster.url}/v2/models/echo/stats", timeout=30).json()
    return int(sum(row["inference_count"] for row in stats["model_stats"]))


def send_many(cluster: Cluster, num: int) -> None:
    def one(_: int) -> int:
        return httpx.post(f"{cluster.url}/v2/models/echo/infer", json=BODY, timeout=30).status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(one, range(num))) == {200}


def test_statistics_sum_every_replica(cluster: Cluster) -> None:
    assert running_replicas("echo") == 2
    before = echo_count(cluster)
    send_many(cluster, 60)
    stats = httpx.get(f"{cluster.url}/v2/models/echo/stats", timeout=30).json()
    (row,) = stats["model_stats"]
    assert row["inference_count"] - before == 60
    assert len(row["replicas"]) == 2  # both replicas answered the collection
    assert row["inference_stats"]["success"]["count"] == row["inference_count"]


def test_metrics_carry_each_replica(cluster: Cluster) -> None:
    send_many(cluster, 20)
    text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    replicas = set()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "fulcrum_request_duration_seconds_count"
                and labels.get("model") == "echo"
            ):
                replicas.add(labels["replica"])
                total += sample.value
    assert len(replicas) == 2, sorted(replicas)
    assert total >= 20


def test_statistics_of_unknown_model_is_404(cluster: Cluster) -> None:
    response = httpx.get(f"{cluster.url}/v2/models/nope/stats", timeout=30)
    assert response.status_code == 404
