"""`fulcrum bench --openai` (its LLM mode) against the engine behind a real `fulcrum serve`."""

from __future__ import annotations

from fulcrum.loadgen.bench import BenchOptions, run_bench
from fulcrum.loadgen.inputs import LengthDist
from fulcrum.loadgen.llm import LlmInputs
from fulcrum.loadgen.windows import MeasurePlan


def test_bench_llm_mode_measures_streaming_figures(server_url: str) -> None:
    options = BenchOptions(
        model="tiny-llama", url=server_url, openai=True, concurrency=(2,),
        plan=MeasurePlan(warmup_s=0.2, window_s=0.5, max_duration_s=1.5),
        llm=LlmInputs(prompt_lengths=LengthDist(8, 16), max_tokens=12),
        slos=("ttft<=10s",),
    )  # fmt: skip
    run = run_bench(options)
    point = run.points[0]
    assert point.num_ok > 0 and not point.errors
    assert point.llm is not None
    assert point.llm.mean_output_tokens == 12  # ignore_eos: fixed output lengths
    assert 0 < point.llm.ttft.p50_ms <= point.latency.p50_ms
    assert point.llm.output_tokens_per_s > 0 and point.llm.tpot.p50_ms > 0
