"""ONNX Runtime backend: one `InferenceSession` per instance, fed by config names.

When the config has a `[tokenizer]`, its BYTES input is turned into token tensors first, and
with `length_bucket_rows = N` a batch is sorted by token length and run in chunks of N rows,
each padded only to its own longest row. With `spin_when_idle = true` a second session, whose
pool threads spin within its runs, runs the batches that run alone while runs are sparse;
the two sessions share the model's embedding tables (one copy in memory, not two). With
`share_session_between_instances = true` one backend (its sessions) serves every instance.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from fulcrum.backends.casting import cast_to
from fulcrum.backends.faster_of_two import FIRST, FasterOfTwo
from fulcrum.backends.idle_gaps import IdleGaps
from fulcrum.backends.onnx_providers import CPU, execution_providers, open_session
from fulcrum.backends.onnx_weights import shared_weights
from fulcrum.backends.params import version_file
from fulcrum.backends.text import TextFrontEnd
from fulcrum.config import ModelConfig
from fulcrum.errors import ConfigError, InvalidInput, ModelError
from fulcrum.parameters import OnnxParameters, decode_parameters
from fulcrum.types import TensorMap

_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_ORT_TYPES: dict[str, np.dtype[np.generic]] = {
    f"tensor({name})": np.dtype(dtype)
    for name, dtype in [
        ("bool", np.bool_),
        ("int8", np.int8),
        ("int16", np.int16),
        ("int32", np.int32),
        ("int64", np.int64),
        ("uint8", np.uint8),
        ("uint16", np.uint16),
        ("uint32", np.uint32),
        ("uint64", np.uint64),
        ("float16", np.float16),
        ("float", np.float32),
        ("double", np.float64),
        ("string", np.object_),
    ]
}


def session_options(
    params: OnnxParameters, *, lone: bool = False, threads: int | None = None
) -> ort.SessionOptions:
    """ORT session options from a model's parameters; `lone`: the `spin_when_idle` session,
    whose pool spins (and goes on spinning after a run unless `spin_between_runs = false`);
    `threads`: its intra-op threads instead of `intra_op_threads`."""
    if params.spin_between_runs is True and not (params.allow_spinning or params.spin_when_idle):
        raise ConfigError(
            "parameter 'spin_between_runs' = true: needs allow_spinning or spin_when_idle = true"
        )
    if params.spin_when_idle and params.allow_spinning:
        raise ConfigError(
            "parameter 'spin_when_idle' = true: the session already spins (allow_spinning = true)"
        )
    options = ort.SessionOptions()
    # 0: ORT's default
    options.intra_op_num_threads = params.intra_op_threads if threads is None else threads
    options.inter_op_num_threads = params.inter_op_threads
    options.graph_optimization_level = _OPT_LEVELS[params.graph_optimization_level]
    # ORT's pool threads spin-wait for work by default; on a small machine the spinning steals
    # the cores the event loop and the other models need, so spinning is opt-in. Within a run it
    # saves a sleeping worker's wake-up per parallel operator. Stopping it when a run returns
    # (`session.force_spinning_stop`) saves ~60 ms of CPU a run, but the next run is then as slow
    # as with no spinning at all (a lone minilm row: 15 against 9 ms; benchmarks/RESULTS.md), so
    # only an explicit `spin_between_runs = false` asks for it.
    spin = "1" if params.allow_spinning or lone else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    if (params.allow_spinning or lone) and params.spin_between_runs is False:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if params.dynamic_block_base:
        # Static splitting gives each pool thread an equal share up front: on cores shared with
        # the event loop and the load generator, one preempted thread holds the whole run back.
        base = str(params.dynamic_block_base)
        options.add_session_config_entry("session.dynamic_block_base", base)
    return options


class OnnxBackend:
    """Runs an ONNX graph with ONNX Runtime; parameters are validated at load."""

    def __init__(self, config: ModelConfig, version_dir: Path) -> None:
        params = decode_parameters(dict(config.parameters), OnnxParameters)
        path = version_file(version_dir, params.model_file, "model_file")
        if not path.is_file():
            raise ConfigError(f"model {config.name!r}: no model file {path}")
        providers = execution_providers(params)
        required = params.execution_providers is not None  # named, so CUDA must start
        on_cpu = providers == [CPU]
        self.name = config.name
        # One backend for all instances: each instance thread calls `execute` on the same
        # sessions, ORT's Run being thread-safe (read by `fulcrum.servable` at load).
        self.shared_between_instances = params.share_session_between_instances
        # With a second session, the tables both read in place are loaded once, here, and
        # handed to both (`add_initializer`: ORT uses the caller's buffer, no copy); kept alive
        # as long as the sessions by this attribute. On a GPU each session copies them anyway.
        self.shared_weights: dict[str, ort.OrtValue] = {}
        if params.spin_when_idle and on_cpu:
            self.shared_weights = _ort_values(path)
        options = self._sharing(session_options(params))
        self.session = open_session(config.name, path, options, providers, required=required)
        # Spinning pool threads answer an isolated call sooner (no sleeping worker to wake) and
        # cost the cores anything else needs, the event loop included, for a while after each
        # run. ORT has no per-run switch (a pool keeps what it was built with), hence a second
        # session, taken only by a batch that runs alone while runs are sparse (light load), and
        # only while it is measured faster (where other processes hold the cores it is not).
        self.lone_session: ort.InferenceSession | None = None
        self.lone_choice = FasterOfTwo()  # FIRST: the spinning session, SECOND: the other
        self.gaps = IdleGaps(params.spin_idle_gap_ms / 1000)
        self._gaps_lock = threading.Lock()  # instance threads sharing this backend
        self.clock = time.perf_counter
        if params.spin_when_idle and on_cpu:  # a GPU's runs wait on no sleeping pool thread
            # A lone batch runs while every other instance idles: it may use all their threads.
            threads = params.intra_op_threads * config.instances.count  # 0 stays ORT's default
            lone = self._sharing(session_options(params, lone=True, threads=threads))
            self.lone_session = open_session(config.name, path, lone, providers, required=required)
        self.front = TextFrontEnd(config.tokenizer, version_dir) if config.tokenizer else None
        self.graph_types = {i.name: _ort_dtype(i.type, i.name) for i in self.session.get_inputs()}
        self._check_inputs(config)
        self.output_names = self._output_names(config)
        self.bucket_rows = params.length_bucket_rows
        if self.bucket_rows and (self.front is None or _has_dynamic_output(config)):
            raise ConfigError(
                f"parameter 'length_bucket_rows' = {self.bucket_rows}: needs a [tokenizer] and "
                "outputs without dynamic axes"
            )

    def _sharing(self, options: ort.SessionOptions) -> ort.SessionOptions:
        for name, value in self.shared_weights.items():
            options.add_initializer(name, value)
        return options

    def _check_inputs(self, config: ModelConfig) -> None:
        provided = {spec.name for spec in config.inputs}
        if self.front is not None:
            provided.discard(self.front.spec.input)
            provided.update(self.front.output_names)
        if not provided:
            return  # no declared inputs: requests name the graph's inputs directly
        unknown = sorted(provided - set(self.graph_types))
        if unknown:
            raise ConfigError(
                f"model {config.name!r}: inputs {unknown} are not in the graph "
                f"(graph inputs: {sorted(self.graph_types)})"
            )

    def _output_names(self, config: ModelConfig) -> list[str]:
        graph_outputs = [o.name for o in self.session.get_outputs()]
        if not config.outputs:
            return graph_outputs
        names = [spec.name for spec in config.outputs]
        unknown = [n for n in names if n not in graph_outputs]
        if unknown:
            raise ConfigError(
                f"model {config.name!r}: outputs {unknown} are not in the graph "
                f"(graph outputs: {graph_outputs})"
            )
        return names

    def execute(self, inputs: TensorMap) -> TensorMap:
        """Run one batch; ONNX Runtime releases the GIL while it computes."""
        self._run_starts()
        try:
            return self._execute(self.session, inputs)
        finally:
            self._run_ends()

    def execute_lone(self, inputs: TensorMap) -> TensorMap:
        """Run a batch that nothing else waits or runs beside: on the spinning session while
        runs are sparse and it is measured faster than the other (tried every few lone runs)."""
        start_s, sparse = self._run_starts()
        session, choice = self.session, None
        if self.lone_session is not None and sparse:
            choice = self.lone_choice.pick()
            session = self.lone_session if choice == FIRST else self.session
        try:
            outputs = self._execute(session, inputs)
        finally:
            end_s = self._run_ends()
        if choice is not None:
            self.lone_choice.observe(choice, end_s - start_s, _num_rows(inputs))
        return outputs

    def lone_state(self) -> dict[str, object] | None:
        """For the statistics API: which session lone batches take and why; None without
        `spin_when_idle`."""
        if self.lone_session is None:
            return None
        choice = self.lone_choice
        names = ("spinning", "instance")  # FIRST, SECOND
        with self._gaps_lock:
            mean_gap_s, sparse = self.gaps.mean_gap_s, self.gaps.sparse
        return {
            "favourite": names[choice.favourite],
            "ms_per_row": _ms_by_name(names, choice.per_row_s),
            "mean_ms_per_row": _ms_by_name(names, choice.mean_per_row_s),
            "runs": dict(zip(names, choice.num_runs, strict=True)),
            "explore_every": choice.explore_interval,
            "mean_idle_gap_ms": None if math.isinf(mean_gap_s) else round(mean_gap_s * 1e3, 3),
            "sparse": sparse,
        }

    def _run_starts(self) -> tuple[float, bool]:
        """The clock at a run's start, and whether runs are sparse."""
        with self._gaps_lock:
            now_s = self.clock()
            return now_s, self.gaps.start(now_s)

    def _run_ends(self) -> float:
        with self._gaps_lock:
            now_s = self.clock()
            self.gaps.end(now_s)
        return now_s

    def _execute(self, session: ort.InferenceSession, inputs: TensorMap) -> TensorMap:
        feeds = self._feeds(inputs)
        if self.front is None or not 0 < self.bucket_rows < _num_rows(feeds):
            return self._run(session, feeds)
        return self._run_bucketed(session, feeds)

    def _run(self, session: ort.InferenceSession, feeds: TensorMap) -> TensorMap:
        try:
            values = session.run(self.output_names, feeds)
        except Exception as exc:
            raise ModelError(f"model {self.name!r} failed: {exc}") from exc
        return dict(zip(self.output_names, values, strict=True))

    def _run_bucketed(self, session: ort.InferenceSession, feeds: TensorMap) -> TensorMap:
        """Sort rows by length, run chunks padded to their own longest, restore the order.
        Padding is on the right, so cutting a chunk's columns to its longest row is exact."""
        assert self.front is not None
        lengths = feeds[self.front.spec.mask].sum(axis=1)  # (N,)
        order = np.argsort(lengths, kind="stable")
        parts: list[TensorMap] = []
        for start in range(0, len(order), self.bucket_rows):
            rows = order[start : start + self.bucket_rows]
            width = int(lengths[rows].max())
            parts.append(self._run(session, {k: v[rows, :width] for k, v in feeds.items()}))
        outputs: TensorMap = {}
        for name in self.output_names:
            merged = np.concatenate([part[name] for part in parts])
            out = np.empty_like(merged)
            out[order] = merged
            outputs[name] = out
        return outputs

    def _feeds(self, inputs: TensorMap) -> TensorMap:
        tensors = dict(inputs)
        if self.front is not None:
            text_name = self.front.spec.input
            # Pre-encoded token tensors are taken too (as the torch backend does): `fulcrum
            # profile` times the tokenizer apart from the graph. Requests never carry them:
            # the protocol refuses inputs the config does not declare.
            if text_name in tensors:
                tensors.update(self.front.encode(tensors.pop(text_name)))
            elif not set(self.front.output_names) <= tensors.keys():
                raise InvalidInput(f"model {self.name!r}: missing input {text_name!r}")
        feeds: TensorMap = {}
        for name, array in tensors.items():
            graph_dtype = self.graph_types.get(name)
            if graph_dtype is None:
                raise InvalidInput(f"model {self.name!r}: unknown input {name!r}")
            feeds[name] = cast_to(name, array, graph_dtype)
        missing = sorted(set(self.graph_types) - set(feeds))
        if missing:
            raise InvalidInput(f"model {self.name!r}: missing inputs {missing}")
        return feeds

    def close(self) -> None:
        # ORT frees the session when the last reference goes; drop ours now.
        self.__dict__.pop("session", None)
        self.lone_session = None
        self.shared_weights = {}


def _ort_values(path: Path) -> dict[str, ort.OrtValue]:
    """The model's shareable tables as OrtValues over arrays of our own (see onnx_weights); none
    when the file does not parse: ORT then loads every weight itself, or names what is wrong."""
    try:
        arrays = shared_weights(path)
    except (ValueError, IndexError, UnicodeDecodeError):
        return {}
    # An OrtValue made from an array on the CPU refers to the array's buffer and holds the array.
    return {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}


def _num_rows(feeds: TensorMap) -> int:
    return len(next(iter(feeds.values()))) if feeds else 0


def _ms_by_name(names: tuple[str, str], seconds: list[float]) -> dict[str, float | None]:
    return {
        name: None if math.isnan(value) else round(value * 1e3, 3)
        for name, value in zip(names, seconds, strict=True)
    }


def _has_dynamic_output(config: ModelConfig) -> bool:
    return any(-1 in spec.shape for spec in config.outputs)


def _ort_dtype(type_name: str, input_name: str) -> np.dtype[np.generic]:
    dtype = _ORT_TYPES.get(type_name)
    if dtype is None:
        raise ConfigError(f"graph input {input_name!r} has unsupported type {type_name}")
    return dtype
