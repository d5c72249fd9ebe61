"""`fulcrum profile` for `platform = "llm"` models: the engine run directly (no HTTP) with 1, 2,
4, ... sequences at once, each of a fixed prompt and output length (greedy, EOS ignored, so every
sequence makes exactly its output tokens); output tokens/s, time to first token, time per output
token, and the knee over tokens/s."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from fulcrum.config import ModelConfig
from fulcrum.errors import InvalidInput, ModelError
from fulcrum.tuning.knee import find_knee, is_flat
from fulcrum.tuning.resources import Nvml, ResourceMonitor, Usage, machine_description

if TYPE_CHECKING:
    from fulcrum.llm.sync_engine import LLMEngine


@dataclass(frozen=True)
class LlmProfileOptions:
    """Concurrent sequences to sweep and the shape of each sequence."""

    batch_sizes: tuple[int, ...] = ()  # sequences at once; (): 1, 2, 4, ... up to max_batch
    max_batch: int = 0  # 0: the engine's max_num_seqs
    prompt_tokens: int = 128
    output_tokens: int = 64
    warmup: int = 1  # unmeasured runs per point
    repeats: int = 3  # measured runs per point (fewer when max_seconds_per_point runs out)
    max_seconds_per_point: float = 30.0
    knee_margin: float = 0.10
    backoff: float = 0.20
    stop_at_knee: bool = True
    seed: int = 0

    def check(self) -> None:
        """InvalidInput naming the first bad option."""
        if any(b < 1 for b in self.batch_sizes) or self.max_batch < 0:
            raise InvalidInput("sequence counts must be >= 1 (and max batch >= 0)")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise InvalidInput("prompt and output tokens must be >= 1")
        if self.warmup < 0 or self.repeats < 1 or self.max_seconds_per_point <= 0:
            raise InvalidInput("warm-up must be >= 0, repeats >= 1 and seconds per point > 0")


class LlmPoint(msgspec.Struct, frozen=True, kw_only=True):
    """N sequences run together; times in ms, medians over the runs' requests."""

    batch_size: int  # sequences running at once
    prompt_tokens: int
    output_tokens: int
    num_runs: int
    num_output_tokens: int  # made in the measured runs: runs x sequences x output_tokens
    output_tokens_per_s: float  # all sequences' output tokens / the run's wall time (median)
    throughput_rps: float  # sequences finished per second (median run)
    latency_ms_p50: float  # a sequence from admission to its last token
    latency_ms_p99: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float  # (last token - first token) / (output tokens - 1)
    tpot_ms_p99: float
    num_preemptions: int  # sequences evicted for KV blocks during the measured runs
    rss_mb_peak: float
    cpu_util: float
    gpu_util_pct: float | None = None
    gpu_mem_mb_peak: float | None = None
    gpu_power_w: float | None = None


class LlmProfileResult(msgspec.Struct, kw_only=True):
    """Every point and the knee over output tokens/s."""

    model: str
    variant: str = ""
    version: str = ""
    platform: str = "llm"
    machine: str
    points: list[LlmPoint]
    latency_ms_b1: float | None  # one sequence alone, admission to last token (median)
    tpot_ms_b1: float | None
    saturation_batch: int
    saturated: bool
    knee_batch: int
    knee_tokens_per_s: float
    knee_throughput_rps: float
    memory_bound_batch: int | None = None  # the KV pool is preallocated: see notes
    notes: list[str] = []

    def to_json(self) -> str:
        """Indented JSON of the whole result."""
        return msgspec.json.format(msgspec.json.encode(self).decode(), indent=2)


@dataclass
class _Run:
    wall_s: float
    num_output_tokens: int
    latency_s: list[float]
    ttft_s: list[float]
    tpot_s: list[float]


def sweep_sequences(max_num_seqs: int, options: LlmProfileOptions) -> tuple[int, ...]:
    """The sequence counts to measure: the options' list, or 1, 2, 4, ... and the limit."""
    if options.batch_sizes:
        return tuple(sorted(set(options.batch_sizes)))
    limit = options.max_batch or max_num_seqs
    sizes = [1]
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes) if sizes[-1] == limit else (*sizes, limit)


def measure_llm(
    config: ModelConfig, version_dir: Path, options: LlmProfileOptions
) -> LlmProfileResult:
    """Load the engine for `config` (a resolved variant's) from `version_dir` and profile it."""
    options.check()
    from fulcrum.llm.params import EngineParams
    from fulcrum.llm.sync_engine import LLMEngine

    params = EngineParams.from_parameters(dict(config.parameters))
    nvml = Nvml.open()
    try:
        monitor = ResourceMonitor(nvml)  # before the load: points include weights and KV pool
        engine = LLMEngine.from_checkpoint(version_dir, params)
        try:
            result = profile_engine(engine, config.name, options, monitor=monitor)
        finally:
            engine.abort_all()
    finally:
        nvml.close()
    result.version = version_dir.name
    return result


def profile_engine(
    engine: LLMEngine, model: str, options: LlmProfileOptions, *, monitor: ResourceMonitor
) -> LlmProfileResult:
    """Profile a loaded engine with nothing else running on it."""
    options.check()
    rng = np.random.default_rng(options.seed)
    points: list[LlmPoint] = []
    notes: list[str] = []
    sizes = sweep_sequences(engine.params.max_num_seqs, options)
    for num_seqs in sizes:
        point = _point(engine, num_seqs, options, monitor, rng, notes)
        if point is None:
            break
        points.append(point)
        if options.stop_at_knee and len(points) > 1:
            before, after = points[-2].output_tokens_per_s, point.output_tokens_per_s
            if is_flat(before, after, options.knee_margin):
                break
    if not points:
        raise ModelError(f"model {model!r}: no point could be measured ({'; '.join(notes)})")
    knee = find_knee(
        [(p.batch_size, p.output_tokens_per_s) for p in points],
        margin=options.knee_margin,
        backoff=options.backoff,
    )
    knee_point = next((p for p in points if p.batch_size == knee.batch), None)
    if knee_point is None:
        knee_point = _point(engine, knee.batch, options, monitor, rng, notes)
        if knee_point is not None:
            points.append(knee_point)
    b1 = next((p for p in points if p.batch_size == 1), None)
    return LlmProfileResult(
        model=model,
        machine=machine_description(monitor.nvml),
        points=sorted(points, key=lambda p: p.batch_size),
        latency_ms_b1=None if b1 is None else b1.latency_ms_p50,
        tpot_ms_b1=None if b1 is None else b1.tpot_ms_p50,
        saturation_batch=knee.saturation_batch,
        saturated=knee.saturated,
        knee_batch=knee.batch,
        knee_tokens_per_s=0.0 if knee_point is None else knee_point.output_tokens_per_s,
        knee_throughput_rps=0.0 if knee_point is None else knee_point.throughput_rps,
        notes=[*notes, *_notes(knee.saturated, sizes, monitor.nvml)],
    )


def _point(
    engine: LLMEngine,
    num_seqs: int,
    options: LlmProfileOptions,
    monitor: ResourceMonitor,
    rng: np.random.Generator,
    notes: list[str],
) -> LlmPoint | None:
    """One point, or None (and a note) when a step failed, e.g. out of memory."""
    runs: list[_Run] = []
    try:
        for _ in range(options.warmup):
            _run(engine, num_seqs, options, rng)
        preempted = engine.scheduler.num_preemptions
        deadline = time.perf_counter() + options.max_seconds_per_point
        monitor.start()
        try:
            while len(runs) < options.repeats:
                runs.append(_run(engine, num_seqs, options, rng))
                if time.perf_counter() >= deadline:
                    break
        finally:
            usage = monitor.stop()
    except ModelError as exc:
        notes.append(f"{num_seqs} sequences failed: {exc.message}")
        return None
    return _summarise(num_seqs, options, runs, engine.scheduler.num_preemptions - preempted, usage)


def _run(
    engine: LLMEngine, num_seqs: int, options: LlmProfileOptions, rng: np.random.Generator
) -> _Run:
    """Admit `num_seqs` sequences at once and step the engine until all have finished."""
    from fulcrum.llm.sampling_params import SamplingParams

    # Greedy and EOS ignored: each sequence makes exactly output_tokens, whatever the weights.
    sampling = SamplingParams(max_tokens=options.output_tokens, temperature=0.0, ignore_eos=True)
    vocab = min(engine.vocab_size, engine.tokenizer.get_vocab_size())
    start = time.perf_counter()
    for i in range(num_seqs):
        # Fresh random prompts: no prefix-cache hits, the cost of new requests.
        prompt = rng.integers(0, vocab, options.prompt_tokens).tolist()
        engine.add_request(f"profile-{i}", prompt, sampling, arrival_s=engine.clock.now())
    first: dict[str, float] = {}
    figures = _Run(0.0, 0, [], [], [])
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.error is not None:
                engine.abort_all()
                raise out.error
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                _record(figures, out.usage.completion_tokens, start, first[out.request_id], now)
    figures.wall_s = time.perf_counter() - start
    return figures


def _record(figures: _Run, num_tokens: int, start: float, first: float, end: float) -> None:
    figures.num_output_tokens += num_tokens
    figures.latency_s.append(end - start)
    figures.ttft_s.append(first - start)
    if num_tokens > 1:
        figures.tpot_s.append((end - first) / (num_tokens - 1))


def _summarise(
    num_seqs: int, options: LlmProfileOptions, runs: list[_Run], num_preemptions: int, usage: Usage
) -> LlmPoint:
    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1000 if values else 0.0

    latency = [x for r in runs for x in r.latency_s]
    ttft = [x for r in runs for x in r.ttft_s]
    tpot = [x for r in runs for x in r.tpot_s]
    gpu = usage.gpu
    return LlmPoint(
        batch_size=num_seqs,
        prompt_tokens=options.prompt_tokens,
        output_tokens=options.output_tokens,
        num_runs=len(runs),
        num_output_tokens=sum(r.num_output_tokens for r in runs),
        output_tokens_per_s=float(np.median([r.num_output_tokens / r.wall_s for r in runs])),
        throughput_rps=float(np.median([num_seqs / r.wall_s for r in runs])),
        latency_ms_p50=pct(latency, 50),
        latency_ms_p99=pct(latency, 99),
        ttft_ms_p50=pct(ttft, 50),
        ttft_ms_p99=pct(ttft, 99),
        tpot_ms_p50=pct(tpot, 50),
        tpot_ms_p99=pct(tpot, 99),
        num_preemptions=num_preemptions,
        rss_mb_peak=usage.rss_mb_peak,
        cpu_util=usage.cpu_util,
        gpu_util_pct=None if gpu is None else gpu.util_pct,
        gpu_mem_mb_peak=None if gpu is None else gpu.mem_mb_peak,
        gpu_power_w=None if gpu is None else gpu.power_w,
    )


def _notes(saturated: bool, sizes: tuple[int, ...], nvml: Nvml) -> list[str]:
    notes = [
        "memory bound: not computed; the KV pool is preallocated (its size, max_num_seqs and "
        "max_num_batched_tokens bound the sequences)"
    ]
    if not saturated:
        notes.append(
            f"tokens/s still grew at {sizes[-1]} sequences: the knee lies beyond the sweep "
            "(raise --max-batch)"
        )
    if not nvml.available:
        notes.append(f"GPU: {nvml.note}")
    return notes
