"""An A/B split and a shadow over a generative model's variants (real tiny engines, `b` with
other weights): the key picks a sticky arm, an explicit variant wins, each arm's requests and
tokens are counted, and greedy requests on `b` are shadowed on `a` with their exact-token
agreement (sampled ones are counted, not compared)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fulcrum.context import RequestContext
from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.routing.ab import arm_of
from fulcrum.server.app import create_app
from fulcrum.service import Service

CONFIG = """platform = "llm"
[parameters]
num_kv_blocks = 64
block_size = 4
max_model_len = 128
[variants.a]
parameters = { model_file = "model.safetensors" }
[variants.b]
parameters = { model_file = "other.safetensors" }
[routing.ab]
arms = { a = 0.5, b = 0.5 }
[routing.shadow]
variant = "a"
fraction = 1.0
"""
ARMS = {"a": 0.5, "b": 0.5}
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 5, "ignore_eos": True,
          "prompt": "Hello"}  # fmt: skip


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    build_tiny_gpt2(tmp_path, name="tiny")
    build_tiny_gpt2(tmp_path, name="other", seed=1)
    shutil.copy(tmp_path / "other" / "1" / "model.safetensors",
                tmp_path / "tiny" / "1" / "other.safetensors")  # fmt: skip
    shutil.rmtree(tmp_path / "other")
    (tmp_path / "tiny" / "config.toml").write_text(CONFIG)
    svc = Service(tmp_path)
    await svc.start()
    yield svc
    await svc.stop()


def key_for(arm: str) -> str:
    return next(f"user-{i}" for i in range(1000) if arm_of("tiny", f"user-{i}", ARMS) == arm)


async def test_the_split_picks_a_variant_and_counts_its_tokens(service: Service) -> None:
    for arm in ("a", "b"):
        ctx = RequestContext("r", "t", "openai", ab_key=key_for(arm))
        assert service._llm(ctx, "tiny")[1].variant == arm
    explicit = RequestContext("r", "t", "openai", ab_key=key_for("a"), variant="b")
    assert service._llm(explicit, "tiny")[1].variant == "b"
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for _ in range(2):
            response = await client.post("/v1/completions", json=GREEDY,
                                         headers={"X-Fulcrum-AB-Key": key_for("b")})  # fmt: skip
            assert response.status_code == 200, response.text
            assert response.headers["Fulcrum-Route"] == "ab=b"
        streamed = await client.post("/v1/completions", json={**GREEDY, "stream": True},
                                     headers={"X-Fulcrum-AB-Key": key_for("a")})  # fmt: skip
        assert streamed.headers["Fulcrum-Route"] == "ab=a"
        chosen = await client.post("/v1/completions", json=GREEDY,
                                   headers={"X-Fulcrum-Variant": "b"})  # fmt: skip
        assert "Fulcrum-Route" not in chosen.headers  # outside the split
        metrics = (await client.get("/metrics")).text
    assert 'fulcrum_ab_requests_total{arm="b",model="tiny",outcome="success"} 2.0' in metrics
    assert 'fulcrum_ab_rows_total{arm="b",model="tiny"} 10.0' in metrics  # 2 x 5 tokens
    # The streamed one on arm a; the one that named variant b is outside the split.
    assert 'fulcrum_ab_requests_total{arm="a",model="tiny",outcome="success"} 1.0' in metrics


async def test_greedy_generations_are_shadowed_on_the_reference(service: Service) -> None:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for key, body in ((key_for("b"), GREEDY), (key_for("a"), GREEDY),
                          (key_for("b"), {**GREEDY, "temperature": 1.0})):  # fmt: skip
            response = await client.post("/v1/completions", json=body,
                                         headers={"X-Fulcrum-AB-Key": key})  # fmt: skip
            assert response.status_code == 200, response.text
        await service.routing.shadows.wait()
        metrics = (await client.get("/metrics")).text
    shadow = service.routing.metrics.stats_json("tiny")["shadow"]
    assert isinstance(shadow, dict)
    # One greedy request on b compared (other weights: its tokens differ); the one on a is the
    # reference's own; the sampled one is counted apart.
    assert (shadow["sent"], shadow["compared"], shadow["sampled"]) == (1, 1, 1)
    assert shadow["agreement_mean"] < 1.0
    assert 'fulcrum_shadow_agreement_count{model="tiny",reference="a"} 1.0' in metrics
    assert 'fulcrum_ab_requests_total{arm="a",model="tiny",outcome="success"} 1.0' in metrics


async def test_arms_and_shadow_agreement_are_in_the_statistics_api(service: Service) -> None:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post("/v1/completions", json=GREEDY,
                                     headers={"X-Fulcrum-AB-Key": key_for("b")})  # fmt: skip
        assert response.status_code == 200, response.text
        await service.routing.shadows.wait()
        rows = (await client.get("/v2/models/tiny/stats")).json()["model_stats"]
    # One row per loaded variant, as for batch models; the routing section is the model's.
    assert sorted((r["name"], r["version"], r["variant"]) for r in rows) == [
        ("tiny", "1", "a"), ("tiny", "1", "b")]  # fmt: skip
    routing = rows[0]["routing"]
    assert routing["ab"]["b"]["success"] == 1 and routing["ab"]["b"]["rows"] == 5
    assert routing["shadow"]["compared"] == 1 and routing["shadow"]["reference"] == "a"
    assert 0.0 <= routing["shadow"]["agreement_mean"] < 1.0
