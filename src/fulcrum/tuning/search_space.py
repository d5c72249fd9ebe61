"""What `fulcrum tune` may change: the candidate configs, each dimension's values, the presets.

A `Candidate` is one point of the space; `changed_keys` says which config keys it changes
against the file, which is both the reload override (`override_for`, whole tables: the server's
override replaces top-level keys) and the `--apply` edit. Threads and instances share the cores,
so they form one dimension of (threads, instances) pairs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import msgspec

from fulcrum.config import ModelConfig
from fulcrum.variants import default_variant, resolve_variant

Scenario = Literal["realtime", "batch", "mixed"]
SCENARIOS: tuple[Scenario, ...] = ("realtime", "batch", "mixed")
# The [parameters] key that sets a platform's intra-op thread count; others have none.
THREAD_PARAMETER = {"onnx": "intra_op_threads", "torch": "num_threads"}
INSTANCE_PLATFORMS = ("onnx", "torch", "python", "echo")
LLM_KEYS = ("max_num_seqs", "max_num_batched_tokens", "block_size")
# The LLM engine's defaults (fulcrum.llm.params.EngineParams) for a config that sets none.
LLM_DEFAULTS = {"max_num_seqs": 64, "max_num_batched_tokens": 1024, "block_size": 16}
_LLM_VALUES = {
    "max_num_seqs": (8, 16, 32, 64, 128, 256),
    "max_num_batched_tokens": (256, 512, 1024, 2048, 4096),
    "block_size": (8, 16, 32),
}
_QUEUE_DELAYS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0)
# Sweep order: the largest effects first, so later sweeps start from a good incumbent.
DIMENSIONS = (
    "variant", "threads_instances", "max_batch_size", "max_queue_delay_ms",
    "preferred_batch_sizes", *LLM_KEYS,
)  # fmt: skip


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One configuration to try; 0 / "" where the model has no such knob."""

    variant: str = ""  # "": the model declares no variants
    max_batch_size: int = 0
    batching: bool = False  # a [dynamic_batching] table (without one, requests run alone)
    max_queue_delay_ms: float = 0.0
    preferred_batch_sizes: tuple[int, ...] = ()
    instances: int = 1
    threads: int = 0  # 0: the backend's default (or no thread knob)
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    block_size: int = 0

    @property
    def num_cores(self) -> int:
        """Cores the candidate asks for (threads x instances); a tie-breaker, fewer is cheaper."""
        return max(1, self.threads) * self.instances

    def label(self) -> str:
        """A compact one-line description for tables and logs."""
        parts = [f"v={self.variant}"] if self.variant else []
        if self.max_num_seqs:
            parts += [
                f"seqs={self.max_num_seqs}",
                f"tokens={self.max_num_batched_tokens}",
                f"block={self.block_size}",
            ]
            return " ".join(parts)
        if self.max_batch_size:
            parts.append(f"b={self.max_batch_size}")
        if self.batching:
            parts.append(f"d={self.max_queue_delay_ms:g}ms")
            if self.preferred_batch_sizes:
                parts.append("pref=" + ",".join(str(s) for s in self.preferred_batch_sizes))
        else:
            parts.append("no-batcher")
        parts.append(f"i={self.instances}")
        if self.threads:
            parts.append(f"t={self.threads}")
        return " ".join(parts)


def current_candidate(config: ModelConfig) -> Candidate:
    """The candidate the file's config is (trial 0)."""
    batching = config.dynamic_batching
    served = resolve_variant(config)  # the default variant's parameters: what serves now
    thread_key = THREAD_PARAMETER.get(config.platform)
    threads = served.parameters.get(thread_key, 0) if thread_key else 0
    llm = {}
    if config.platform == "llm":
        llm = {k: _int(served.parameters.get(k, LLM_DEFAULTS[k])) for k in LLM_KEYS}
    return Candidate(
        variant=default_variant(config) if config.variants else "",
        max_batch_size=config.max_batch_size,
        batching=batching is not None,
        max_queue_delay_ms=batching.max_queue_delay_ms if batching else 0.0,
        preferred_batch_sizes=tuple(batching.preferred_batch_sizes) if batching else (),
        instances=config.instances.count,
        threads=_int(threads),
        **llm,
    )


def _int(value: object) -> int:
    # The backends validate parameters; a value they would refuse is no knob to start from.
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def changed_keys(config: ModelConfig, candidate: Candidate) -> dict[str, object]:
    """The dotted config keys `candidate` changes against the file, with their new values."""
    now = current_candidate(config)
    keys: dict[str, object] = {}
    if candidate.variant != now.variant:
        keys["default_variant"] = candidate.variant
    if candidate.max_batch_size != now.max_batch_size:
        keys["max_batch_size"] = candidate.max_batch_size
    turned_on = candidate.batching and not now.batching
    if turned_on or candidate.max_queue_delay_ms != now.max_queue_delay_ms:
        keys["dynamic_batching.max_queue_delay_ms"] = float(candidate.max_queue_delay_ms)
    if candidate.preferred_batch_sizes != now.preferred_batch_sizes:
        keys["dynamic_batching.preferred_batch_sizes"] = list(candidate.preferred_batch_sizes)
    if candidate.instances != now.instances:
        keys["instances.count"] = candidate.instances
    thread_key = THREAD_PARAMETER.get(config.platform)
    if thread_key and candidate.threads and candidate.threads != now.threads:
        keys[f"parameters.{thread_key}"] = candidate.threads
    for key in LLM_KEYS:
        value = getattr(candidate, key)
        if value and value != getattr(now, key):
            keys[f"parameters.{key}"] = value
    return keys


def override_for(config: ModelConfig, keys: dict[str, object]) -> dict[str, object]:
    """The load request's config override for `keys`: every touched table sent whole (the file's
    table with the changes), because the server replaces top-level keys, not nested ones."""
    file: dict[str, object] = msgspec.to_builtins(config)
    override: dict[str, object] = {}
    for dotted, value in keys.items():
        top, _, rest = dotted.partition(".")
        if not rest:
            override[top] = value
            continue
        if top not in override:
            base = file.get(top)
            override[top] = copy.deepcopy(base) if isinstance(base, dict) else {}
        table = override[top]
        assert isinstance(table, dict)
        table[rest] = value
    return override


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """The values of each dimension; a dimension with one value is not swept."""

    variants: tuple[str, ...] = ()
    thread_pairs: tuple[tuple[int, int], ...] = ()  # (threads, instances); threads 0: no knob
    batch_sizes: tuple[int, ...] = ()
    queue_delays_ms: tuple[float, ...] = ()
    preferred: bool = False
    llm: dict[str, tuple[int, ...]] | None = None

    def dimensions(self) -> list[str]:
        """The dimensions to sweep, in sweep order."""
        sizes = {
            "variant": len(self.variants),
            "threads_instances": len(self.thread_pairs),
            "max_batch_size": len(self.batch_sizes),
            "max_queue_delay_ms": len(self.queue_delays_ms),
            "preferred_batch_sizes": 3 if self.preferred else 0,
            **{k: len(v) for k, v in (self.llm or {}).items()},
        }
        return [name for name in DIMENSIONS if sizes.get(name, 0) > 1]

    def sweep(self, name: str, base: Candidate) -> list[Candidate]:
        """`base` with dimension `name` set to each of its values, in sweep order."""
        replace = msgspec.structs.replace
        if name == "variant":
            return [replace(base, variant=v) for v in self.variants]
        if name == "threads_instances":
            return [replace(base, threads=t, instances=i) for t, i in self.thread_pairs]
        if name == "max_batch_size":
            return [fit(replace(base, max_batch_size=b, batching=True)) for b in self.batch_sizes]
        if name == "max_queue_delay_ms":
            return [
                replace(base, max_queue_delay_ms=d, batching=True) for d in self.queue_delays_ms
            ]
        if name == "preferred_batch_sizes":
            return [replace(base, preferred_batch_sizes=p) for p in preferred_options(base)]
        if self.llm is not None and name in self.llm:
            return [replace(base, **{name: v}) for v in self.llm[name]]
        raise KeyError(name)


def fit(candidate: Candidate) -> Candidate:
    """Drop preferred batch sizes a smaller max_batch_size no longer admits."""
    kept = tuple(s for s in candidate.preferred_batch_sizes if s <= candidate.max_batch_size)
    return msgspec.structs.replace(candidate, preferred_batch_sizes=kept)


def preferred_options(base: Candidate) -> list[tuple[int, ...]]:
    """None, the max batch, or half and the max: Triton's batcher sends a preferred size at
    once instead of waiting out the queue delay for a bigger batch."""
    top = base.max_batch_size
    options: list[tuple[int, ...]] = [()]
    if top >= 2:
        options.append((top,))
    if top >= 4:
        options.append((top // 2, top))
    return options


def thread_pairs(num_cores: int) -> tuple[tuple[int, int], ...]:
    """(threads, instances) filling the cores (t x i = cores), and 1 x 1: for 2 cores 1x2, 2x1,
    1x1. Oversubscribing cores only adds contention, so no pair asks for more."""
    pairs = [(num_cores // i, i) for i in range(1, num_cores + 1) if num_cores % i == 0]
    if (1, 1) not in pairs:
        pairs.append((1, 1))
    return tuple(pairs)


def instance_counts(num_cores: int) -> tuple[int, ...]:
    """Instance counts for platforms without a thread knob: powers of two up to the cores."""
    counts = [1]
    while counts[-1] * 2 <= num_cores:
        counts.append(counts[-1] * 2)
    if counts[-1] != num_cores:
        counts.append(num_cores)
    return tuple(counts)


def batch_sizes(config: ModelConfig, min_rows: int) -> tuple[int, ...]:
    """Powers of two from the rows one request carries up to the file's max_batch_size (never
    above it: the file's bound may be a memory limit), plus both ends and the current value."""
    top = config.max_batch_size
    if top < 1:
        return ()
    low = min(max(1, min_rows), top)
    sizes = {low, top}
    size = 1
    while size < top:
        if size >= low:
            sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


def queue_delays(slo_bound_ms: float | None) -> tuple[float, ...]:
    """0, then delays up to half the latency bound: a longer wait alone spends the budget."""
    limit = slo_bound_ms / 2 if slo_bound_ms else 20.0
    return (0.0, *(d for d in _QUEUE_DELAYS_MS if d <= limit))


def llm_values(current: Candidate) -> dict[str, tuple[int, ...]]:
    """The LLM engine's knobs: the usual powers of two, and the current value."""
    return {k: tuple(sorted({*_LLM_VALUES[k], getattr(current, k)})) for k in LLM_KEYS}


@dataclass(frozen=True, slots=True)
class VariantChoice:
    """The variants the search may pick, and why each other one is left out."""

    allowed: tuple[str, ...]
    skipped: dict[str, str]


def eligible_variants(config: ModelConfig, max_fidelity_loss: float) -> VariantChoice:
    """Loaded variants within `max_fidelity_loss` (1 - recorded fidelity) of their reference.

    A variant without a recorded fidelity is allowed only when it is itself a reference (the
    default, or one another variant was measured against): an unmeasured one could be anything.
    """
    if not config.variants:
        return VariantChoice((), {})
    references = {default_variant(config)} | {
        v.figures.reference for v in config.variants.values() if v.figures.reference
    }
    allowed: list[str] = []
    skipped: dict[str, str] = {}
    for name, variant in config.variants.items():
        fidelity = variant.figures.fidelity
        if not variant.load:
            skipped[name] = "load = false: the server does not load it"
        elif fidelity is None and name not in references:
            skipped[name] = "no recorded fidelity (run `fulcrum quantize`)"
        elif fidelity is not None and 1.0 - fidelity > max_fidelity_loss:
            metric = variant.figures.fidelity_metric or "fidelity"
            skipped[name] = (
                f"{metric} {fidelity:.4f} loses {1.0 - fidelity:.2%} > allowed "
                f"{max_fidelity_loss:.2%}"
            )
        else:
            allowed.append(name)
    return VariantChoice(tuple(allowed), skipped)


def build_space(
    config: ModelConfig,
    *,
    variants: tuple[str, ...],
    num_cores: int,
    min_rows: int,
    slo_bound_ms: float | None,
    only: tuple[str, ...] = (),
) -> SearchSpace:
    """The search space of one model on `num_cores` cores; `only`: sweep just these dimensions."""
    current = current_candidate(config)

    def keep(name: str) -> bool:
        return not only or name in only

    if config.platform == "llm":
        llm = {k: v for k, v in llm_values(current).items() if keep(k)}
        return SearchSpace(variants=variants if keep("variant") else (), llm=llm)
    pairs: tuple[tuple[int, int], ...] = ()
    if config.platform in THREAD_PARAMETER:
        pairs = thread_pairs(num_cores)
    elif config.platform in INSTANCE_PLATFORMS:
        pairs = tuple((0, i) for i in instance_counts(num_cores))
    sizes = batch_sizes(config, min_rows)
    return SearchSpace(
        variants=variants if keep("variant") else (),
        thread_pairs=pairs if keep("threads_instances") else (),
        batch_sizes=sizes if keep("max_batch_size") else (),
        queue_delays_ms=queue_delays(slo_bound_ms) if sizes and keep("max_queue_delay_ms") else (),
        preferred=bool(sizes) and keep("preferred_batch_sizes"),
    )


def preset(scenario: Scenario, config: ModelConfig, space: SearchSpace) -> Candidate:
    """The scenario's starting point (the sweeps still explore from there).

    realtime: batches of one, no queue delay, the fastest variant at batch 1 (recorded latency),
    all threads in one instance. batch: the largest batch (the recorded knee when there is one),
    a quantized variant (highest recorded throughput), the longest queue delay, that batch as
    preferred size. mixed: the middle batch size and delay, the current variant.
    """
    current = current_candidate(config)
    replace = msgspec.structs.replace
    if space.llm is not None:
        # Few sequences and small steps keep TTFT and TPOT short; many and big ones fill the
        # hardware. The KV block size is no latency/throughput dial: it stays.
        pick = 0 if scenario == "realtime" else -1
        dials = ("max_num_seqs", "max_num_batched_tokens")
        values = {k: v[pick] for k, v in space.llm.items() if k in dials}
        values = values if scenario != "mixed" else {}
        return replace(current, variant=_preset_variant(scenario, config, space), **values)
    start = replace(current, variant=_preset_variant(scenario, config, space))
    if space.batch_sizes:
        sizes, delays = space.batch_sizes, space.queue_delays_ms or (0.0,)
        if scenario == "realtime":
            start = replace(start, max_batch_size=sizes[0], max_queue_delay_ms=0.0)
        elif scenario == "batch":
            top = _knee(config, start.variant, sizes)
            start = replace(start, max_batch_size=top, max_queue_delay_ms=delays[-1],
                            preferred_batch_sizes=(top,))  # fmt: skip
        else:
            start = replace(start, max_batch_size=sizes[len(sizes) // 2],
                            max_queue_delay_ms=delays[len(delays) // 2])  # fmt: skip
        start = fit(replace(start, batching=True))
    if scenario == "realtime" and space.thread_pairs:
        start = replace(start, threads=space.thread_pairs[0][0], instances=1)
    return start


def _preset_variant(scenario: Scenario, config: ModelConfig, space: SearchSpace) -> str:
    current = default_variant(config) if config.variants else ""
    figures = {name: config.variants[name].figures for name in space.variants}
    if scenario == "realtime":
        timed = {n: f.latency_ms for n, f in figures.items() if f.latency_ms is not None}
        return min(timed, key=lambda n: timed[n]) if timed else current
    if scenario == "batch":
        quantized = [n for n in space.variants if config.variants[n].precision not in ("", "fp32")]
        rated = {n: figures[n].throughput_rps or 0.0 for n in quantized}
        return max(rated, key=lambda n: rated[n]) if rated else current
    return current


def _knee(config: ModelConfig, variant: str, sizes: tuple[int, ...]) -> int:
    """The largest swept size within the variant's recorded knee batch (else the largest)."""
    knee = config.variants[variant].figures.knee_batch if variant else None
    if knee is None:
        return sizes[-1]
    within = [s for s in sizes if s <= knee]
    return within[-1] if within else sizes[0]
