"""A backend that echoes its inputs after `a + b * batch_size` ms: for tests and benchmarks."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from fulcrum.config import ModelConfig
from fulcrum.errors import ModelError
from fulcrum.parameters import EchoParameters, decode_parameters
from fulcrum.types import TensorMap


class EchoBackend:
    """Output i is input i. Parameters: `latency_a_ms`, `latency_b_ms`, `fail_value`.

    `fail_value`: a batch whose first input contains this number raises, so tests can make one
    batch fail on purpose.
    """

    def __init__(self, config: ModelConfig, version_dir: Path | None = None) -> None:
        params = decode_parameters(dict(config.parameters), EchoParameters)
        self.latency_a_s = params.latency_a_ms / 1000
        self.latency_b_s = params.latency_b_ms / 1000
        self.fail_value = params.fail_value
        self.pairs = [(i.name, o.name) for i, o in zip(config.inputs, config.outputs, strict=False)]
        self.batched = config.max_batch_size > 0
        self.num_batches = 0

    def execute(self, inputs: TensorMap) -> TensorMap:
        first = inputs[self.pairs[0][0]] if self.pairs else None
        batch_size = len(first) if first is not None and self.batched and first.ndim else 1
        delay_s = self.latency_a_s + self.latency_b_s * batch_size
        if delay_s > 0:
            time.sleep(delay_s)
        self.num_batches += 1
        if (
            self.fail_value is not None
            and first is not None
            and first.dtype != np.object_
            and bool(np.any(first == self.fail_value))
        ):
            raise ModelError(f"echo: input contains fail_value {self.fail_value}")
        return {out: inputs[inp] for inp, out in self.pairs if inp in inputs}

    def close(self) -> None:
        pass
