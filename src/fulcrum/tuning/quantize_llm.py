"""`fulcrum quantize` for `platform = "llm"` models: weight-only projections, int8
(per-output-channel symmetric) in `model.int8.safetensors` and int4 (group-wise, asymmetric,
128 columns a group) in `model.int4.safetensors`, the LM head int8 in both (a tied input
embedding then reads its rows from it), next to the float weights and selected by the variant's
`model_file` and `quantization` parameters. Fidelity: teacher-forced greedy-token
agreement and the perplexity ratio (`fulcrum.tuning.llm_fidelity`); speed: time per output token
of one sequence and output tokens/s at a fixed number of sequences, through the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fulcrum.config import ModelConfig, ParamValue
from fulcrum.errors import ConfigError, ModelError
from fulcrum.tuning.fidelity import Fidelity
from fulcrum.tuning.quantize import QuantizeJob, Speed, VariantFile

if TYPE_CHECKING:
    import torch

    from fulcrum.llm.loader import LoadedLLM
    from fulcrum.llm.params import EngineParams
    from fulcrum.tuning.llm_fidelity import LlmFidelity
    from fulcrum.tuning.profile import ProfileOptions

INT8_FILE = "model.int8.safetensors"
INT4_FILE = "model.int4.safetensors"
FILES = {"int8": INT8_FILE, "int4": INT4_FILE}
FIDELITY_METRIC = "token_agreement"
CONCURRENCY = 8  # sequences at once for the throughput figure (unless --batch-sizes names one)
PROMPT_TOKENS = 32  # each measured sequence: this prompt, then OUTPUT_TOKENS greedy tokens
OUTPUT_TOKENS = 32
LM_HEAD = "lm_head"  # quant.LM_HEAD (fulcrum.llm.quant loads torch: imported only to quantize)


@dataclass(frozen=True)
class LlmFidelityOptions:
    """The prompts and text the fidelity is measured on (from the shipped English corpus)."""

    num_prompts: int = 8
    prompt_words: int = 8
    continuation_tokens: int = 32
    chunk_tokens: int = 128
    max_chunks: int = 8
    # The LM head's precision in both variants ("int8", "int4" or "none": float). int8 per
    # output channel: on the 1B shape it decodes as fast as an int4 head and agrees better.
    lm_head: str = "int8"
    int4_group_size: int = 128  # input columns sharing one int4 scale and zero point
    int4_symmetric: bool = False  # True: zero point 8 (GPTQ's sym); False: one per group


class LlmQuantizer:
    """The `Quantizer` of `fulcrum.tuning.quantize` for the LLM engine."""

    supported: tuple[str, ...] = ("int8", "int4")
    default_model_file = "model.safetensors"

    def __init__(self, options: LlmFidelityOptions | None = None) -> None:
        self.options = options or LlmFidelityOptions()

    def write(self, job: QuantizeJob, precision: str) -> VariantFile:
        """Quantize the reference's float32 weights, write the file, and measure its fidelity
        against the reference (both at the serving dtype) in the same run."""
        if precision not in self.supported:
            raise ConfigError(f"precision {precision!r}: the LLM engine writes {self.supported}")
        from fulcrum.llm import quant
        from fulcrum.llm.loader import load_checkpoint

        params = _engine_params(job.config)
        source = load_checkpoint(
            job.version_dir,
            model_file=params.model_file,
            quantization=params.quantization,
        )
        module: torch.nn.Module = source.model  # type: ignore[assignment]
        already = quant.module_quantization(module)
        if already != quant.NONE:
            raise ConfigError(
                f"variant {job.reference!r} is already {already}: quantize a float one"
            )
        opts = self.options
        tied = quant.tied_head(module)
        names = quant.quantize_model(
            module,
            precision,
            lm_head=opts.lm_head,
            group_size=opts.int4_group_size,
            symmetric=opts.int4_symmetric,
        )
        path = job.version_dir / FILES[precision]
        quant.save_quantized(module, path, source=params.model_file or "*.safetensors")
        parameters: dict[str, ParamValue] = {
            "model_file": FILES[precision],
            "quantization": precision,
        }
        found = self._compare(job, {**job.config.parameters, **parameters})
        notes = (
            _layers_note(names, precision, opts, tied=tied),
            f"fidelity: teacher-forced greedy-token agreement at {found.num_tokens} positions "
            f"({self.options.num_prompts} prompts), worst prompt {found.worst_prompt:.3f}",
            f"perplexity ratio {found.perplexity_ratio:.4f} ({precision} "
            f"{found.perplexity_variant:.2f}"
            f" / float {found.perplexity_reference:.2f} on {found.num_text_tokens} tokens)",
            "latency = time per output token of 1 sequence; throughput = sequences/s (and "
            "output tokens/s in the figures) at "
            f"{CONCURRENCY} at once unless --batch-sizes names a count ({PROMPT_TOKENS}-token "
            f"prompts, {OUTPUT_TOKENS} new tokens each)",
        )
        return VariantFile(precision, parameters, (path,), notes=notes, fidelity=_fidelity(found))

    def fidelity(self, job: QuantizeJob, variant: ModelConfig) -> Fidelity:
        return _fidelity(self._compare(job, dict(variant.parameters)))

    def measure(self, job: QuantizeJob, config: ModelConfig, options: ProfileOptions) -> Speed:
        """TPOT of one sequence alone and throughput at a fixed number of sequences."""
        from fulcrum.tuning.profile_llm import LlmProfileOptions, measure_llm

        concurrency = max(options.batch_sizes) if options.batch_sizes else CONCURRENCY
        llm_options = LlmProfileOptions(
            batch_sizes=tuple(sorted({1, concurrency})),
            prompt_tokens=PROMPT_TOKENS,
            output_tokens=OUTPUT_TOKENS,
            warmup=max(1, options.warmup),
            repeats=options.repeats,
            max_seconds_per_point=options.max_seconds_per_point,
            stop_at_knee=False,
            seed=options.seed,
        )
        result = measure_llm(config, job.version_dir, llm_options)
        point = next((p for p in result.points if p.batch_size == concurrency), None)
        if point is None:
            raise ModelError(f"{concurrency} sequences could not be measured: {result.notes}")
        return Speed(
            result.tpot_ms_b1,
            concurrency,
            point.throughput_rps,
            result.machine,
            output_tokens_per_s=point.output_tokens_per_s,
        )

    def _compare(self, job: QuantizeJob, variant_parameters: dict[str, object]) -> LlmFidelity:
        from fulcrum.llm.loader import load_checkpoint
        from fulcrum.tuning.llm_fidelity import compare_llms

        ref_params = _engine_params(job.config)
        var_params = _engine_params_from(dict(variant_parameters))
        loaded: list[LoadedLLM] = [
            load_checkpoint(
                job.version_dir,
                dtype=p.dtype,
                device=p.resolve_device(),
                model_file=p.model_file,
                quantization=p.quantization,
            )
            for p in (ref_params, var_params)
        ]
        prompts, text = self._samples(loaded[0])
        return compare_llms(
            loaded[0],
            loaded[1],
            ref_params,
            prompts,
            text,
            num_tokens=self.options.continuation_tokens,
        )

    def _samples(self, loaded: LoadedLLM) -> tuple[list[list[int]], list[list[int]]]:
        """Prompts (the first words of the corpus's lines) and the corpus as scored text."""
        from fulcrum.llm.example_corpus import CORPUS
        from fulcrum.tuning.llm_fidelity import text_chunks

        opts = self.options
        lines = [line.split() for line in CORPUS.splitlines() if len(line.split()) > 1]
        heads = [" ".join(words[: opts.prompt_words]) for words in lines[: opts.num_prompts]]
        prompts = [loaded.tokenizer.encode(h).ids for h in heads]
        limit = loaded.max_model_len
        chunk = min(opts.chunk_tokens, limit)
        ids = list(loaded.tokenizer.encode(CORPUS).ids)
        return [p[: limit - opts.continuation_tokens] for p in prompts], text_chunks(
            ids, chunk, opts.max_chunks
        )


def _fidelity(found: LlmFidelity) -> Fidelity:
    return Fidelity(
        found.agreement,
        FIDELITY_METRIC,
        worst_row=found.worst_prompt,
        perplexity_ratio=found.perplexity_ratio,
    )


def _layers_note(names: list[str], precision: str, opts: LlmFidelityOptions, *, tied: bool) -> str:
    """What was quantized, as the variant's first note."""
    quantized_head = LM_HEAD in names
    if not quantized_head:
        head = "LM head float" + (" (tied to the input embedding)" if tied else ", embedding float")
    elif tied:
        head = f"LM head {_scheme(opts.lm_head, opts)}, tied: lookups dequantize its rows"
    else:
        head = f"LM head {_scheme(opts.lm_head, opts)}; input embedding float"
    num_projections = len(names) - quantized_head
    return f"{num_projections} projections {_scheme(precision, opts)}; {head}; norms float"


def _scheme(precision: str, opts: LlmFidelityOptions) -> str:
    if precision == "int8":
        return "int8 (per-channel symmetric)"
    kind = "symmetric" if opts.int4_symmetric else "asymmetric"
    return f"int4 ({kind}, groups of {opts.int4_group_size} input columns)"


def _engine_params(config: ModelConfig) -> EngineParams:
    return _engine_params_from(dict(config.parameters))


def _engine_params_from(parameters: dict[str, object]) -> EngineParams:
    from fulcrum.llm.params import EngineParams

    return EngineParams.from_parameters(parameters)
