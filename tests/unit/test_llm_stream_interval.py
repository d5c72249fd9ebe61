"""`stream_interval` in LLMEngine on the tiny Llama: a running request's tokens go out every N
tokens (its first at once, its end at once), and what a client reads in total (token ids, text,
logprobs, finish reason, usage) is the same as with N = 1: across stop strings and stop tokens
that land mid-chunk, lengths that are not a multiple of N, aborts, failed steps, preemption and
speculative drafts."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fulcrum.errors import ConfigError
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.speculative import SpeculativeConfig
from fulcrum.llm.sync_engine import LLMEngine

PROMPTS = {"a": "The cat", "b": "Hello there", "c": "Once upon a time"}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    directory: Path = tmp_path_factory.mktemp("models")
    build_tiny_llama(directory)
    return load_checkpoint(directory / "tiny-llama" / "1")


@dataclass
class Read:
    """What a client of one request read: its outputs, in order."""

    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return [len(o.new_token_ids) for o in self.outputs]

    @property
    def whole(self) -> dict[str, Any]:
        """Everything read, joined: equal between intervals."""
        last = self.outputs[-1]
        return {
            "token_ids": [t for o in self.outputs for t in o.new_token_ids],
            "text": "".join(o.new_text for o in self.outputs),
            "logprobs": [lp for o in self.outputs for lp in o.new_logprobs],
            "prompt_logprobs": self.outputs[0].prompt_logprobs,
            "finish_reason": last.finish_reason,
            "usage": (last.usage.prompt_tokens, last.usage.completion_tokens),
            "finished_once": [o.finished for o in self.outputs].count(True),
        }


def _engine(loaded: LoadedLLM, interval: int, **params: Any) -> LLMEngine:
    values: dict[str, Any] = {"num_kv_blocks": 64, "stream_interval": interval, **params}
    return LLMEngine(loaded, EngineParams(**values))


def _run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, Read]:
    for request_id, sampling in requests.items():
        engine.add_request(request_id, engine.encode(PROMPTS[request_id]), sampling)
    reads = {request_id: Read() for request_id in requests}
    while engine.has_unfinished():
        for output in engine.step():
            reads[output.request_id].outputs.append(output)
    return reads


def _greedy(max_tokens: int, **fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **fields)


def _pattern(num_tokens: int, interval: int) -> list[int]:
    """Chunk sizes: the first token alone, then full chunks, then what is left."""
    rest = (num_tokens - 1) % interval
    return [1] + [interval] * ((num_tokens - 1) // interval) + ([rest] if rest else [])


def test_default_is_one_and_bad_values_are_refused() -> None:
    assert EngineParams().stream_interval == 1
    assert EngineParams.from_parameters({"stream_interval": 8}).stream_interval == 8
    for bad, message in ((0, "= 0: must be >= 1"), (-2, "= -2: must be >= 1"),
                         (True, "= True: expected int"), (2.5, "= 2.5: expected int"),
                         ("4", "= '4': expected int")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"parameters.stream_interval' {message}"):
            EngineParams.from_parameters({"stream_interval": bad})


@pytest.mark.parametrize("interval", [4, 7])
def test_chunks_of_interval_and_the_same_read_as_every_token(
    loaded: LoadedLLM, interval: int
) -> None:
    requests = {
        "a": _greedy(23, logprobs=2),  # 23: not a multiple of 4 or 7
        "b": _greedy(8, prompt_logprobs=1),
        "c": _greedy(interval * 3 + 1),  # ends on a full chunk
    }
    every = _run(_engine(loaded, 1), requests)
    chunked = _run(_engine(loaded, interval), requests)
    for request_id, sampling in requests.items():
        assert chunked[request_id].whole == every[request_id].whole, request_id
        assert every[request_id].sizes == [1] * sampling.max_tokens
        assert chunked[request_id].sizes == _pattern(sampling.max_tokens, interval)
    assert chunked["b"].outputs[0].prompt_logprobs is not None  # with the first token
    assert len(chunked["a"].outputs[1].new_logprobs) == interval  # one per token of a chunk


def _first_piece(loaded: LoadedLLM, request_id: str, num_tokens: int, after: int) -> int:
    """The index of a token (> after) whose text first appears where it is generated."""
    read = _run(_engine(loaded, 1), {request_id: _greedy(num_tokens)})[request_id]
    offset = 0
    for index, output in enumerate(read.outputs):
        text = "".join(o.new_text for o in read.outputs)
        if index > after and output.new_text.strip() and text.find(output.new_text) == offset:
            return index
        offset += len(output.new_text)
    raise AssertionError("no piece to stop on: pick another prompt")


def test_stop_string_mid_chunk_cuts_the_same_text(loaded: LoadedLLM) -> None:
    index = _first_piece(loaded, "c", 30, after=5)
    full = _run(_engine(loaded, 1), {"c": _greedy(30)})["c"]
    stop = full.outputs[index].new_text.strip()
    requests = {"c": _greedy(30, stop=(stop,))}
    every = _run(_engine(loaded, 1), requests)["c"]
    assert every.whole["finish_reason"] == "stop"
    assert stop not in every.whole["text"]
    for interval in (4, 7):
        chunked = _run(_engine(loaded, interval), requests)["c"]
        assert chunked.whole == every.whole, interval
        assert max(chunked.sizes) <= interval


def test_stop_token_mid_chunk_ends_in_the_same_step(loaded: LoadedLLM) -> None:
    full = _run(_engine(loaded, 1), {"a": _greedy(30)})["a"].whole["token_ids"]
    index = next(i for i in range(6, 30) if full.index(full[i]) == i and i % 4 != 0)
    requests = {"a": _greedy(30, stop_token_ids=(full[index],))}
    every = _run(_engine(loaded, 1), requests)["a"]
    assert every.whole["finish_reason"] == "stop"
    assert len(every.whole["token_ids"]) <= index + 1
    chunked = _run(_engine(loaded, 4), requests)["a"]
    assert chunked.whole == every.whole
    assert chunked.sizes == _pattern(len(every.whole["token_ids"]), 4)


def test_abort_mid_chunk_hands_back_the_held_tokens(loaded: LoadedLLM) -> None:
    engine = _engine(loaded, 4)
    engine.add_request("a", engine.encode(PROMPTS["a"]), _greedy(40))
    sent = [t for _ in range(3) for o in engine.step() for t in o.new_token_ids]
    assert len(sent) == 1  # the first token; the next two are held
    aborted = engine.abort("a")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert len(aborted.new_token_ids) == 2
    every = _run(_engine(loaded, 1), {"a": _greedy(40)})["a"].whole
    assert sent + aborted.new_token_ids == every["token_ids"][:3]
    assert not engine.has_unfinished()


def test_a_failed_step_hands_back_the_held_tokens_before_its_error(loaded: LoadedLLM) -> None:
    engine = _engine(loaded, 4)
    engine.add_request("a", engine.encode(PROMPTS["a"]), _greedy(40))
    sent = [o for _ in range(3) for o in engine.step()]
    run, calls = engine.runner.run, itertools.count()

    def failing_run(batch: Any) -> Any:
        if next(calls) == 0:
            raise RuntimeError("device lost")
        return run(batch)

    engine.runner.run = failing_run  # type: ignore[method-assign]
    held, error = engine.step()
    assert held.finish_reason is None and len(held.new_token_ids) == 2
    every = _run(_engine(loaded, 1), {"a": _greedy(40)})["a"].outputs[:3]
    assert [t for o in [*sent, held] for t in o.new_token_ids] == [
        t for o in every for t in o.new_token_ids
    ]
    assert "".join(o.new_text for o in [*sent, held]) == "".join(o.new_text for o in every)
    assert error.finish_reason == "error" and error.error is not None
    assert not engine.has_unfinished()


def test_a_preempted_request_hands_back_its_held_tokens(loaded: LoadedLLM) -> None:
    # 6 blocks of 16 tokens: two requests of ~60 tokens cannot both stay.
    requests = {"a": _greedy(60), "b": _greedy(60)}
    every = _run(_engine(loaded, 1, num_kv_blocks=6), requests)
    engine = _engine(loaded, 4, num_kv_blocks=6)
    for request_id, sampling in requests.items():
        engine.add_request(request_id, engine.encode(PROMPTS[request_id]), sampling)
    reads = {request_id: Read() for request_id in requests}
    num_flushed = 0
    while engine.has_unfinished():
        preemptions = engine.scheduler.num_preemptions
        outputs = engine.step()
        for output in outputs:
            reads[output.request_id].outputs.append(output)
        if engine.scheduler.num_preemptions > preemptions:  # the victim has nothing held now
            for request_id, state in engine._requests.items():
                num_read = sum(reads[request_id].sizes)
                if state.seq.num_computed_tokens == 0 and state.seq.num_output_tokens:
                    assert num_read == state.seq.num_output_tokens
                    num_flushed += 1
    assert num_flushed >= 1, "no preemption: shrink the KV pool"
    for request_id in requests:
        assert reads[request_id].whole == every[request_id].whole, request_id
        assert max(reads[request_id].sizes) <= 4


def test_speculative_chunks_hold_every_accepted_draft(loaded: LoadedLLM) -> None:
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    requests = {"a": _greedy(40), "b": _greedy(33, logprobs=1)}
    every = _run(_engine(loaded, 1, speculative=spec), requests)
    engine = _engine(loaded, 4, speculative=spec)
    chunked = _run(engine, requests)
    for request_id in requests:
        assert chunked[request_id].whole == every[request_id].whole, request_id
        sizes = chunked[request_id].sizes
        assert sizes[0] == 1 and all(size <= 4 - 1 + 1 + 3 for size in sizes)  # held + a step
        assert all(size >= 4 for size in sizes[1:-1])  # held until at least the interval
    assert engine.speculation is not None
