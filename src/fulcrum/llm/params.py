"""Engine parameters from a `platform = "llm"` model's `[parameters]` table, validated once.

`max_num_batched_tokens` is THE latency/throughput dial: it caps the tokens one engine step
computes (decodes plus prefill chunks). Small values keep every step short, which favours time to
first token of running requests and inter-token latency; large values fill the hardware with
prefill work, which favours throughput and the TTFT of long prompts under light load.
With `slo_ttft_ms` / `slo_tpot_ms` set, `fulcrum.llm.budget` moves the dial within its bounds as
the load changes; without them the dial stays where it is set.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fulcrum.errors import ConfigError
from fulcrum.llm.speculative import SpeculativeConfig
from fulcrum.llm.tool_parsers import PARSER_NAMES

_DTYPES = ("float32", "float16", "bfloat16")
_QUANTIZATIONS = ("auto", "none", "int8", "int4")  # "auto": what the weights file's metadata says
_SLO_TTFT_ACTIONS = ("shed", "queue")  # a request predicted to miss slo_ttft_ms: 503 or admit


@dataclass(frozen=True)
class EngineParams:
    """How one LLM engine runs; every field is a key of `[parameters]` in config.toml."""

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 0  # 0: size the pool from kv_cache_memory_mb
    kv_cache_memory_mb: float = 256.0
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 1024  # token budget per step: the latency/throughput dial
    max_num_waiting: int = 256  # admission queue bound; beyond it requests get 503
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda when available, else cpu
    max_model_len: int = 0  # 0: the model's own limit
    drain_timeout_s: float = 10.0  # stop(): how long in-flight requests may finish
    model_file: str = ""  # "": every float *.safetensors; a variant names model.int8.safetensors
    quantization: str = "auto"  # "none" / "int8" / "int4": refuse a file that holds otherwise
    num_threads: int = 0  # torch intra-op threads of this engine's thread; 0: torch's default
    # Step the model in a child process of its own (vLLM V1's engine core process), so its
    # Python runs beside the server's event loop on another core; false: a thread in the server.
    engine_process: bool = False
    # Data parallelism (vLLM's data_parallel_size): this many engine processes, each a whole
    # engine with these parameters (its own weights, KV pool, max_num_seqs and torch threads);
    # new requests go to the least loaded, with prefix affinity (fulcrum.llm.engine_group).
    # Above 1 it implies engine_process; at most one per CPU core the server may use.
    num_engine_processes: int = 1
    # An engine process that has requests but sends no step for this long is hung (a deadlock,
    # a stuck kernel): it is killed, its requests get a 503 naming the stall, and it restarts.
    # Far above any step, a long prefill's or the first one's warm-up included.
    engine_step_timeout_s: float = 60.0
    # SLOs (0: none). With either set the token budget and running limit adapt to the load
    # (fulcrum.llm.budget) between min_num_batched_tokens and max_num_batched_tokens.
    slo_ttft_ms: float = 0.0  # arrival to first token
    slo_tpot_ms: float = 0.0  # time per output token (inter-token latency)
    min_num_batched_tokens: int = 0  # the adaptive budget's floor; 0: the running sequences
    slo_ttft_action: str = "shed"  # predicted to miss slo_ttft_ms: "shed" (503) or "queue"
    # A chat request may bring its own Jinja template (vLLM's --trust-request-chat-template);
    # off by default: a template is code, even sandboxed and bounded.
    trust_request_chat_template: bool = False
    # How tool_choice "auto" reads this model's calls (vLLM's --tool-call-parser names: hermes,
    # llama3_json, mistral, pythonic); "": none, and "auto" is a 400 (fulcrum.llm.tool_parsers).
    tool_call_parser: str = ""
    # A running request's new tokens go out every stream_interval tokens (SGLang's and vLLM's
    # --stream-interval) instead of every token: its first token and its end go out at once.
    # Fewer, larger chunks cost the server less per token (the engine process's report, its
    # pipe, the text, the stream wake-ups); 1: every token as it is made.
    stream_interval: int = 1
    # Speculative decoding without a draft model (fulcrum.llm.speculative); None: off.
    speculative: SpeculativeConfig | None = None

    @classmethod
    def from_parameters(cls, parameters: dict[str, Any]) -> EngineParams:
        """Read and check `config.parameters`; ConfigError names the key and the value."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in parameters.items():
            if key not in known:
                raise ConfigError(
                    f"key 'parameters.{key}': unknown; expected one of {sorted(known)}"
                )
            if key == "speculative":  # a table of its own
                values[key] = SpeculativeConfig.from_table(value)
                continue
            values[key] = _coerce(key, value, type(getattr(cls, key)))
        params = cls(**values)
        params.validate()
        if parameters.get("engine_process") is False and params.num_engine_processes > 1:
            raise ConfigError(
                f"key 'parameters.num_engine_processes' = {params.num_engine_processes}: runs "
                "the engine in processes of their own, but engine_process is false; drop one"
            )
        return params

    def validate(self) -> None:
        """Range checks."""
        for key in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_num_waiting",
                    "num_engine_processes", "stream_interval"):  # fmt: skip
            if getattr(self, key) < 1:
                raise ConfigError(f"key 'parameters.{key}' = {getattr(self, key)}: must be >= 1")
        for key in ("num_kv_blocks", "max_model_len", "num_threads"):
            if getattr(self, key) < 0:
                raise ConfigError(f"key 'parameters.{key}' = {getattr(self, key)}: must be >= 0")
        if self.kv_cache_memory_mb <= 0:
            raise ConfigError(
                f"key 'parameters.kv_cache_memory_mb' = {self.kv_cache_memory_mb}: must be > 0"
            )
        self._validate_timeouts()
        if self.dtype not in _DTYPES:
            raise ConfigError(f"key 'parameters.dtype' = {self.dtype!r}: expected one of {_DTYPES}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(
                f"key 'parameters.device' = {self.device!r}: expected auto, cpu or cuda[:N]"
            )
        self._validate_weights()
        self._validate_slo()
        if self.tool_call_parser and self.tool_call_parser not in PARSER_NAMES:
            raise ConfigError(
                f"key 'parameters.tool_call_parser' = {self.tool_call_parser!r}: expected one "
                f"of {list(PARSER_NAMES)}"
            )

    @property
    def uses_process(self) -> bool:
        """True when the engine steps in processes of its own rather than a server thread."""
        return self.engine_process or self.num_engine_processes > 1

    @property
    def has_slo(self) -> bool:
        """True when a TTFT or TPOT SLO is set: the token budget then adapts to the load."""
        return self.slo_ttft_ms > 0 or self.slo_tpot_ms > 0

    def _validate_slo(self) -> None:
        for key in ("slo_ttft_ms", "slo_tpot_ms", "min_num_batched_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"key 'parameters.{key}' = {getattr(self, key)}: must be >= 0")
        if self.min_num_batched_tokens > self.max_num_batched_tokens:
            raise ConfigError(
                f"key 'parameters.min_num_batched_tokens' = {self.min_num_batched_tokens}: "
                f"must be <= max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        if self.slo_ttft_action not in _SLO_TTFT_ACTIONS:
            raise ConfigError(
                f"key 'parameters.slo_ttft_action' = {self.slo_ttft_action!r}: "
                f"expected one of {_SLO_TTFT_ACTIONS}"
            )

    def _validate_timeouts(self) -> None:
        if self.drain_timeout_s < 0:
            raise ConfigError(
                f"key 'parameters.drain_timeout_s' = {self.drain_timeout_s}: must be >= 0"
            )
        if self.engine_step_timeout_s <= 0:
            raise ConfigError(
                f"key 'parameters.engine_step_timeout_s' = {self.engine_step_timeout_s}: "
                "must be > 0"
            )

    def _validate_weights(self) -> None:
        # A file name inside the version folder: never a path that leads out of it.
        name = self.model_file
        if name and (name != Path(name).name or name in (".", "..")):
            raise ConfigError(f"key 'parameters.model_file' = {name!r}: expected a file name")
        if name and not name.endswith(".safetensors"):
            raise ConfigError(f"key 'parameters.model_file' = {name!r}: expected *.safetensors")
        if self.quantization not in _QUANTIZATIONS:
            raise ConfigError(
                f"key 'parameters.quantization' = {self.quantization!r}: "
                f"expected one of {_QUANTIZATIONS}"
            )

    def resolve_device(self) -> str:
        """The torch device to run on: cuda when asked or available, else cpu."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _coerce(key: str, value: Any, kind: type) -> Any:
    # bool is an int subclass: `block_size = true` is a mistake, not 1.
    ok = (
        isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is not float
        else isinstance(value, int | float) and not isinstance(value, bool)
    )
    if not ok:
        raise ConfigError(f"key 'parameters.{key}' = {value!r}: expected {kind.__name__}")
    return float(value) if kind is float else value
