"""One local Ray cluster of two nodes (a head and a worker, both `ray start`) for the whole
session, and the test repository deployed on it. Ray must never start on the host network:
`scripts/ray-tests.sh` runs these tests in a fresh namespace that has only loopback, and the
fixture refuses (fails, never skips) anywhere else."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from ray_cluster import (
    APP,
    CLUSTER_ENV,
    Cluster,
    build_repository,
    free_port,
    only_loopback,
    ray_cli,
    wait_ready,
)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not only_loopback():
        pytest.fail(
            "Ray tests start a Ray cluster and must run in a loopback-only network namespace: "
            "run `bash scripts/ray-tests.sh` (never Ray on the host network)"
        )
    import ray
    from fulcrum.ray import app_builder
    from ray import serve

    repository = tmp_path_factory.mktemp("ray-models")
    models = build_repository(repository)
    port, http_port = free_port(), free_port()
    os.environ.update(CLUSTER_ENV)
    ray_cli("start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
         "--node-ip-address=127.0.0.1", "--disable-usage-stats")  # fmt: skip
    ray_cli("start", f"--address=127.0.0.1:{port}", "--num-cpus=2", "--node-ip-address=127.0.0.1")
    address = f"127.0.0.1:{port}"
    ray.init(address=address, logging_level="WARNING")
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        http = {"host": "127.0.0.1", "port": http_port}
        serve.start(proxy_location="HeadOnly", http_options=http)
        serve.run(app_builder({"repository": str(repository)}), name=APP, route_prefix="/")
        url = f"http://127.0.0.1:{http_port}"
        wait_ready(url)
        yield Cluster(address, url, repository, tuple(models))
    finally:
        serve.shutdown()
        ray.shutdown()
        ray_cli("stop", "--force")
