"""Fidelity and speed of a batch model's variant (ONNX, torch): run through its own backend,
the same `create_backend` the server uses, on the validation rows; measured with `fulcrum
profile`'s `measure`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fulcrum.config import ModelConfig
from fulcrum.tuning.fidelity import Fidelity, compare
from fulcrum.tuning.profile import ProfileOptions
from fulcrum.tuning.quantize import QuantizeJob, Speed
from fulcrum.types import TensorMap


class BatchQuantizer:
    """Fidelity and speed of a variant run through its own batch backend (ONNX, torch)."""

    supported: tuple[str, ...] = ()
    default_model_file = ""

    def __init__(self) -> None:
        self._reference_outputs: dict[str, TensorMap] = {}

    def outputs(self, config: ModelConfig, job: QuantizeJob) -> TensorMap:
        """The outputs of `config`'s backend on the validation rows, run in batches."""
        from fulcrum.backends import create_backend

        backend = create_backend(config, job.version_dir)
        try:
            return run_rows(backend.execute, job.validation.inputs, config.max_batch_size)
        finally:
            backend.close()

    def fidelity(self, job: QuantizeJob, variant: ModelConfig) -> Fidelity:
        if job.reference not in self._reference_outputs:
            self._reference_outputs[job.reference] = self.outputs(job.config, job)
        reference = self._reference_outputs[job.reference]
        labels = job.validation.labels
        return compare(reference, self.outputs(variant, job), metric=job.metric, labels=labels)

    def measure(self, job: QuantizeJob, config: ModelConfig, options: ProfileOptions) -> Speed:
        from fulcrum.tuning.profile import measure

        result = measure(config, job.version_dir, options, samples=job.validation.inputs)
        return Speed(
            result.latency_ms_b1, result.knee_batch, result.knee_throughput_rps, result.machine
        )


def run_rows(run: Callable[[TensorMap], TensorMap], inputs: TensorMap, max_batch: int) -> TensorMap:
    """`inputs` (N rows) through `run` in batches of at most `max_batch` rows (0: one unbatched
    row at a time), outputs joined on axis 0."""
    num_rows = len(next(iter(inputs.values())))
    step = min(max_batch, 32) if max_batch > 0 else 1
    parts: list[TensorMap] = []
    for start in range(0, num_rows, step):
        if max_batch > 0:
            parts.append(run({k: v[start : start + step] for k, v in inputs.items()}))
        else:  # a model that does not batch takes one row without the row axis
            out = run({k: v[start] for k, v in inputs.items()})
            parts.append({k: v[np.newaxis] for k, v in out.items()})
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
