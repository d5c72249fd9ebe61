"""Structured output in the engine, on a tiny random GPT-2: the mask fill overlaps the model's
forward, matchers live and die with their sequences (finish, abort, preemption), a complete
grammar stops the answer, and a grammar wins over min_tokens."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import numpy as np
import pytest
import torch

from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.structured import Matcher, StructuredOutputs, llguidance_fill
from fulcrum.llm.structured_spec import StructuredSpec
from fulcrum.llm.sync_engine import LLMEngine

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredSpec("json_schema", json.dumps(SCHEMA))
WAIT_S = 30.0  # a bound for a hang, never a speed expectation


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    directory = tmp_path_factory.mktemp("models")
    build_tiny_gpt2(directory, name="tiny")
    return load_checkpoint(directory / "tiny" / "1")


def _engine(loaded: LoadedLLM, **params: Any) -> LLMEngine:
    return LLMEngine(loaded, EngineParams(**{"num_kv_blocks": 64, **params}))


def _run(engine: LLMEngine) -> dict[str, tuple[str, str | None]]:
    texts: dict[str, str] = {}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            reasons[out.request_id] = out.finish_reason
    return {rid: (texts[rid], reasons[rid]) for rid in texts}


def _add(engine: LLMEngine, rid: str, spec: StructuredSpec | None, **sampling: Any) -> None:
    params = SamplingParams(**{"max_tokens": 40, "seed": 1, "structured": spec, **sampling})
    engine.add_request(rid, engine.encode("Hello there"), params)


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"ok", "n"}
        and isinstance(value["ok"], bool)
        and isinstance(value["n"], int)
        and value["n"] >= 0
    )


class _OverlapModel:
    """The model, whose forward waits until the mask fill has started elsewhere."""

    def __init__(self, model: Any, fill_started: threading.Event) -> None:
        self.model = model
        self.fill_started = fill_started
        self.forward_started = threading.Event()
        self.saw_fill_during_forward: list[bool] = []

    def __call__(self, *args: Any) -> torch.Tensor:
        self.forward_started.set()
        self.saw_fill_during_forward.append(self.fill_started.wait(WAIT_S))
        hidden: torch.Tensor = self.model(*args)
        return hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def test_the_mask_fill_overlaps_the_forward(loaded: LoadedLLM) -> None:
    engine = _engine(loaded)
    fill_started = threading.Event()
    model = _OverlapModel(engine.runner.model, fill_started)
    engine.runner.model = model  # type: ignore[assignment,unused-ignore]
    real_fill = llguidance_fill()
    fill_threads: list[threading.Thread] = []
    fill_saw_forward: list[bool] = []

    def fill(matchers: list[Matcher], bitmask: np.ndarray) -> None:
        fill_threads.append(threading.current_thread())
        fill_started.set()
        # Only a fill that runs while the forward runs sees it start (and lets it go on).
        fill_saw_forward.append(model.forward_started.wait(WAIT_S))
        real_fill(matchers, bitmask)

    engine.runner.structured = StructuredOutputs(engine.grammars.compile, engine.vocab_size, fill)
    _add(engine, "a", JSON_SPEC)
    text, reason = _run(engine)["a"]
    assert model.saw_fill_during_forward and all(model.saw_fill_during_forward)
    assert fill_saw_forward and all(fill_saw_forward)
    assert threading.current_thread() not in fill_threads
    assert reason == "stop" and _valid(text)


def test_json_schema_output_validates_at_temperature_one(loaded: LoadedLLM) -> None:
    engine = _engine(loaded)
    for seed in range(6):
        _add(engine, f"r{seed}", JSON_SPEC, seed=seed, temperature=1.0)
    _add(engine, "plain", None, temperature=1.0)
    results = _run(engine)
    for seed in range(6):
        text, reason = results[f"r{seed}"]
        assert reason == "stop" and _valid(text), text
    assert not engine.runner.structured._tracked  # type: ignore[union-attr,unused-ignore]  # all released


def test_a_complete_grammar_stops_before_min_tokens(loaded: LoadedLLM) -> None:
    engine = _engine(loaded)
    _add(engine, "c", StructuredSpec("choice", '["yes", "no"]'), min_tokens=20, max_tokens=30)
    _add(engine, "r", StructuredSpec("regex", "[a-c]{3}"), ignore_eos=True)
    results = _run(engine)
    assert results["c"][0] in ("yes", "no") and results["c"][1] == "stop"
    assert re.fullmatch("[a-c]{3}", results["r"][0]) and results["r"][1] == "stop"


def test_abort_and_finish_release_the_matcher(loaded: LoadedLLM) -> None:
    engine = _engine(loaded)
    _add(engine, "a", JSON_SPEC)
    _add(engine, "b", JSON_SPEC)
    structured = engine.runner.structured
    assert structured is not None
    seq_a = engine._requests["a"].seq.seq_id
    seq_b = engine._requests["b"].seq.seq_id
    engine.step()
    assert seq_a in structured and seq_b in structured
    engine.abort("a")
    assert seq_a not in structured and seq_b in structured
    _run(engine)
    assert seq_b not in structured


def test_an_invalid_grammar_is_refused_before_queueing(loaded: LoadedLLM) -> None:
    engine = _engine(loaded)
    with pytest.raises(Exception, match="unclosed group"):
        _add(engine, "bad", StructuredSpec("regex", "(a"))
    assert not engine.has_unfinished()
    assert not engine.runner.structured._tracked  # type: ignore[union-attr,unused-ignore]


def test_preempted_structured_sequences_still_follow_their_grammar(loaded: LoadedLLM) -> None:
    # 10 blocks of 4 tokens for 4 sequences that each need up to 12: preemptions must happen.
    engine = _engine(loaded, num_kv_blocks=10, block_size=4, max_num_seqs=4)
    for i in range(4):
        _add(engine, f"r{i}", JSON_SPEC, seed=i, temperature=1.0, max_tokens=30)
    results = _run(engine)
    assert engine.scheduler.num_preemptions > 0
    for i in range(4):
        text, reason = results[f"r{i}"]
        assert reason == "stop" and _valid(text), text
