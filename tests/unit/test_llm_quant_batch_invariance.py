"""A quantized linear layer gives a row the same bits whether it is computed alone or beside 95
others, so a prefix-cache hit (a few rows) never changes a greedy token that a full prefill
(many rows) would give: int4 and int8, every layer width."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fulcrum.llm import cpu_bf16, quant  # noqa: E402
from fulcrum.llm.examples import build_tiny_llama  # noqa: E402
from fulcrum.llm.loader import load_checkpoint  # noqa: E402
from fulcrum.llm.params import EngineParams  # noqa: E402
from fulcrum.llm.quant_int4 import Int4Linear  # noqa: E402
from fulcrum.llm.sampling_params import SamplingParams  # noqa: E402
from fulcrum.llm.sync_engine import LLMEngine  # noqa: E402

pytestmark = pytest.mark.skipif(
    not cpu_bf16.cpu_has_bf16(),
    reason="the fused kernels serve every row count only where the CPU has native bfloat16",
)
NUM_ROWS = 96


def _layer(kind: str, out_features: int, in_features: int) -> quant.Int8Linear | Int4Linear:
    torch.manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features)
    if kind == quant.INT8:
        return quant.Int8Linear.from_linear(linear)
    return Int4Linear.from_linear(linear, 32)


# --- the finding: 1-row and many-row steps rounded differently -----------------------------


@pytest.mark.parametrize("kind", [quant.INT8, quant.INT4])
@pytest.mark.parametrize(("out_features", "in_features"), [(256, 512), (32, 64), (96, 160)])
def test_a_row_alone_and_in_a_batch_of_96_gives_the_same_bits(
    kind: str, out_features: int, in_features: int
) -> None:
    layer = _layer(kind, out_features, in_features)
    x = torch.randn(NUM_ROWS, in_features, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        batch = layer(x)  # (96, N): before any kernel copy exists, then after
        alone = torch.cat([layer(x[i : i + 1]) for i in range(NUM_ROWS)])
        some = layer(x[:40])
        again = layer(x)
    assert torch.equal(alone, batch)
    assert torch.equal(some, batch[:40])
    assert torch.equal(again, batch)


@pytest.mark.parametrize("precision", [quant.INT4, quant.INT8])
def test_a_prefix_cached_quantized_run_equals_an_uncached_one_token_for_token(
    tmp_path: Path, precision: str
) -> None:
    build_tiny_llama(tmp_path)
    version_dir = tmp_path / "tiny-llama" / "1"
    module = load_checkpoint(version_dir).model
    quant.quantize_model(module, precision, group_size=32)  # type: ignore[arg-type]
    file = f"model.{precision}.safetensors"
    quant.save_quantized(module, version_dir / file, source="test")  # type: ignore[arg-type]
    rng = random.Random(3)
    prefix = [rng.randrange(2, 500) for _ in range(48)]  # three cached blocks of 16
    prompts = [prefix + [rng.randrange(2, 500) for _ in range(3 + i)] for i in range(6)]
    runs = [_greedy(version_dir, file, prompts, cached) for cached in (False, True)]
    uncached, cached = runs
    assert cached.num_hits > 0 and uncached.num_hits == 0  # the second run did hit the cache
    assert cached.tokens == uncached.tokens


class _Run:
    def __init__(self, tokens: list[list[int]], num_hits: int) -> None:
        self.tokens, self.num_hits = tokens, num_hits


def _greedy(version_dir: Path, file: str, prompts: list[list[int]], cached: bool) -> _Run:
    """Each prompt alone, in turn (the first fills the cache; the rest hit its prefix)."""
    params = EngineParams(
        model_file=file,
        device="cpu",
        kv_cache_memory_mb=16,
        enable_prefix_caching=cached,
    )
    engine = LLMEngine.from_checkpoint(version_dir, params)
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens: list[list[int]] = []
    num_hits = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, sampling)
        found: list[int] = []
        while engine.has_unfinished():
            for output in engine.step():
                found.extend(output.new_token_ids)
                num_hits += output.usage.cached_tokens if output.finished else 0
        tokens.append(found)
    return _Run(tokens, num_hits)
