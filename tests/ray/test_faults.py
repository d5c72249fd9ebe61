"""Faults and changes under load: a replica killed mid-load (no request hangs, failures bounded,
the replica replaced), a rolling update with no failed request, autoscaling up under load and
down when idle on the SLO signals, and a model that scales to zero and back."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from ray_cluster import APP, Cluster, running_replicas, wait_for

pytestmark = pytest.mark.ray
BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
CLIENT_TIMEOUT_S = 30.0  # a request past this is a hang: the ingress bounds every call first


@contextmanager
def load(cluster: Cluster, model: str, num_clients: int) -> Iterator[Counter[object]]:
    """Closed-loop clients on `model` while the block runs; counts outcomes by status (or the
    exception name of a request that never got an answer)."""
    outcomes: Counter[object] = Counter()
    stop = threading.Event()
    url = f"{cluster.url}/v2/models/{model}/infer"

    def client() -> None:
        with httpx.Client(timeout=CLIENT_TIMEOUT_S) as http:
            while not stop.is_set():
                try:
                    outcomes[http.post(url, json=BODY).status_code] += 1
                except httpx.HTTPError as exc:
                    outcomes[type(exc).__name__] += 1

    with ThreadPoolExecutor(num_clients) as pool:
        futures = [pool.submit(client) for _ in range(num_clients)]
        try:
            yield outcomes
        finally:
            stop.set()
            for future in futures:
                future.result(timeout=CLIENT_TIMEOUT_S + 5)


def replica_names(model: str) -> list[str]:
    from fulcrum.ray.app import HUB_NAME
    from ray import serve

    hub = serve.get_deployment_handle(HUB_NAME, app_name=APP)
    replicas = hub.replicas.remote().result(timeout_s=30)
    return sorted(r for r, m in replicas.items() if m == model)


def test_replica_killed_under_load(cluster: Cluster) -> None:
    import ray

    with load(cluster, "echo", 6) as outcomes:
        wait_for(lambda: outcomes[200] > 50, 60, "load started")
        victims = replica_names("echo")
        assert len(victims) == 2
        ray.kill(ray.get_actor(victims[0], namespace="serve"))  # its id is its actor name
        at_kill = sum(outcomes.values())
        wait_for(lambda: sum(outcomes.values()) > at_kill + 100, 60, "load went on")
    failed = {k: v for k, v in outcomes.items() if k != 200}
    assert not any(isinstance(k, str) for k in failed), failed  # no hang, no dropped connection
    assert set(failed) <= {503}, failed  # a clear "retry", never a 500
    assert sum(failed.values()) <= 6, failed  # at most the requests in flight on the victim
    wait_for(lambda: running_replicas("echo") == 2, 90, "the killed replica replaced")


def test_rolling_update_fails_no_request(cluster: Cluster) -> None:
    from fulcrum.ray import app_builder
    from ray import serve

    def served_version() -> str:
        url = f"{cluster.url}/v2/models/rolling/infer"
        return str(httpx.post(url, json=BODY, timeout=30).json()["model_version"])

    assert served_version() == "1"
    with load(cluster, "rolling", 4) as outcomes:
        wait_for(lambda: outcomes[200] > 20, 60, "load started")
        (cluster.repository / "rolling" / "2").mkdir()  # a new model version
        serve.run(app_builder({"repository": str(cluster.repository)}), name=APP, route_prefix="/")
        wait_for(lambda: served_version() == "2", 120, "version 2 served")
        done = sum(outcomes.values())
        wait_for(lambda: sum(outcomes.values()) > done + 20, 60, "load after the update")
    assert set(outcomes) == {200}, outcomes
    assert running_replicas("rolling") == 2


def test_autoscales_up_under_load_and_down_when_idle(cluster: Cluster) -> None:
    assert running_replicas("slow") == 1
    with load(cluster, "slow", 12) as outcomes:
        took_up_s = wait_for(lambda: running_replicas("slow") >= 2, 120, "scale up under load")
    assert outcomes[200] > 0
    took_down_s = wait_for(lambda: running_replicas("slow") == 1, 180, "scale down when idle")
    print(f"slow: up after {took_up_s:.1f} s of load, down after {took_down_s:.1f} s idle")


def test_scales_to_zero_and_back(cluster: Cluster) -> None:
    url = f"{cluster.url}/v2/models/zero/infer"
    wait_for(lambda: running_replicas("zero") == 0, 120, "zero replicas while idle")
    start = time.monotonic()
    response = httpx.post(url, json=BODY, timeout=120)
    cold_s = time.monotonic() - start
    assert response.status_code == 200, response.text
    assert running_replicas("zero") == 1
    wait_for(lambda: running_replicas("zero") == 0, 120, "back to zero when idle")
    print(f"zero: first request answered after a cold start of {cold_s:.1f} s")
