"""What stopping ONNX Runtime's spin when a run returns does to the next run, in one process.

    .venv/bin/python benchmarks/spin_stop.py --repository /tmp/bench_models [--gaps 0.1,0.3,0.5]
        [--trials 40]

Sessions of the `minilm` graph, all in this process and built as Fulcrum builds them
(`fulcrum.backends.onnx.session_options`, 2 intra-op threads, `dynamic_block_base = 4`, the
embedding tables shared as with `spin_when_idle`), beside ONNX Runtime's default session (the
bare app's). Each trial runs every session once, in a fresh random order, each call of one
tokenised sentence after a random idle gap of 0.5-1.5x the gap, from one thread; the first five
calls of each session are unmeasured. Prints each session's P10 / P50 / P90 call time in ms per
gap. The sessions: ORT's defaults; spinning that goes on after a run (`spin_between_runs` unset,
the default since 2026-12-02); spinning stopped when a run returns (`spin_between_runs = false`,
`session.force_spinning_stop = 1`); no spinning (the shipped main session).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from fulcrum.backends.onnx import _ort_values, session_options
from fulcrum.parameters import OnnxParameters

TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank today."
SHIPPED = {"intra_op_threads": 2, "dynamic_block_base": 4, "spin_when_idle": True}
SESSIONS: dict[str, tuple[dict[str, object], bool] | None] = {  # parameters, lone session
    "ORT defaults": None,
    "spinning, on after runs": ({}, True),
    "spinning, stopped at run end": ({"spin_between_runs": False}, True),
    "no spinning": ({}, False),
}


def build(model: Path, shared: dict[str, ort.OrtValue]) -> dict[str, ort.InferenceSession]:
    """The sessions; `shared`: the tables they read in place, to be kept alive as long."""
    providers = ["CPUExecutionProvider"]
    out = {}
    for name, spec in SESSIONS.items():
        if spec is None:
            options = ort.SessionOptions()
        else:
            overrides, lone = spec
            options = session_options(OnnxParameters(**{**SHIPPED, **overrides}), lone=lone)
            for key, value in shared.items():
                options.add_initializer(key, value)
        out[name] = ort.InferenceSession(str(model), options, providers=providers)
    return out


def measure(sessions: dict[str, ort.InferenceSession], feeds: dict[str, np.ndarray], gap_s: float,
            trials: int, seed: int) -> dict[str, list[float]]:  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in sessions}
    rnd = random.Random(seed)

    def run() -> None:  # on a thread of its own, as an instance thread runs a batch
        for session in sessions.values():
            for _ in range(5):
                session.run(None, feeds)
        for _ in range(trials):
            order = list(sessions)
            rnd.shuffle(order)
            for name in order:
                time.sleep(rnd.uniform(0.5 * gap_s, 1.5 * gap_s))
                start = time.perf_counter()
                sessions[name].run(None, feeds)
                times[name].append((time.perf_counter() - start) * 1e3)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--gaps", default="0.1,0.3,0.5", help="idle gaps between calls, s")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    version = args.repository / "minilm" / "1"
    tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to a fixed length; a lone row runs unpadded
    encoding = tokenizer.encode(TEXT)
    feeds = {
        name: np.array([values], dtype=np.int64)
        for name, values in (("input_ids", encoding.ids),
                             ("attention_mask", encoding.attention_mask),
                             ("token_type_ids", encoding.type_ids))
    }  # fmt: skip
    shared = _ort_values(version / "model.onnx")  # ORT reads these buffers: keep them alive
    sessions = build(version / "model.onnx", shared)
    for gap_s in (float(g) for g in args.gaps.split(",")):
        times = measure(sessions, feeds, gap_s, args.trials, args.seed)
        print(f"gap ~{gap_s:g} s, {args.trials} calls each, ms P10 / P50 / P90:")
        for name, values in times.items():
            values.sort()
            n = len(values)
            print(f"  {name:30} {values[n // 10]:6.2f} {statistics.median(values):6.2f} "
                  f"{values[9 * n // 10]:6.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
