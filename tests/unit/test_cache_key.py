"""Cache keys: every field that determines an answer changes the key, the tenant always does,
and one value in different memory layouts gives one key."""

from __future__ import annotations

import dataclasses
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from fulcrum.cache.key import (
    KEY_BYTES,
    files_fingerprint,
    llm_key,
    load_identity,
    scope_key,
    tensor_key,
)
from fulcrum.llm.sampling_params import SamplingParams

ID = load_identity("m", 1, "default", b"files")
X = np.arange(6, dtype=np.float32).reshape(3, 2)


def key(**change: object) -> bytes:
    parts: dict[str, object] = {
        "identity": ID, "tenant": "acme", "inputs": {"x": X}, "parameters": {},
    } | change  # fmt: skip
    return tensor_key(**parts)  # type: ignore[arg-type]


def test_a_key_is_32_bytes_and_stable() -> None:
    assert len(key()) == KEY_BYTES
    assert key() == key(inputs={"x": X.copy()})


@pytest.mark.parametrize(
    "change",
    [
        {"identity": load_identity("other", 1, "default", b"files")},
        {"identity": load_identity("m", 2, "default", b"files")},
        {"identity": load_identity("m", 1, "int8", b"files")},
        {"identity": load_identity("m", 1, "default", b"other files")},
        {"tenant": "globex"},
        {"tenant": ""},
        {"inputs": {"y": X}},  # input name
        {"inputs": {"x": X.astype(np.float64)}},  # datatype
        {"inputs": {"x": X.view(np.int32)}},  # same bytes, other datatype
        {"inputs": {"x": X.reshape(2, 3)}},  # same bytes, other shape
        {"inputs": {"x": X + 1}},  # content
        {"inputs": {"x": X, "y": X}},  # an extra input
        {"parameters": {"top_k": 3}},
        {"parameters": {"classification": 1}},
    ],
)
def test_every_field_changes_the_key(change: dict[str, object]) -> None:
    assert key(**change) != key()


def test_one_value_in_any_layout_or_byte_order_gives_one_key() -> None:
    fortran = np.asfortranarray(X)
    assert not fortran.flags.c_contiguous
    big_endian = X.astype(">f4")
    assert key(inputs={"x": fortran}) == key()
    assert key(inputs={"x": big_endian}) == key()
    assert key(inputs={"x": X[::1]}) == key()


def test_input_order_and_parameter_order_do_not_matter() -> None:
    a = {"a": X, "b": X + 1}
    b = {"b": X + 1, "a": X}
    assert key(inputs=a) == key(inputs=b)
    assert key(parameters={"p": 1, "q": 2}) == key(parameters={"q": 2, "p": 1})


def test_bytes_elements_are_length_prefixed() -> None:
    one = np.array([b"ab", b"c"], dtype=object)
    other = np.array([b"a", b"bc"], dtype=object)
    assert key(inputs={"t": one}) != key(inputs={"t": other})
    assert key(inputs={"t": one}) == key(inputs={"t": np.array([b"ab", b"c"], dtype=object)})


def test_a_large_contiguous_input_is_hashed_without_a_copy() -> None:
    big = np.zeros((2048, 2048), dtype=np.float32)  # 16 MiB
    tracemalloc.start()
    try:
        assert key(inputs={"x": big}) != key()
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < big.nbytes // 16  # a copy (tobytes, ascontiguousarray) would be 16 MiB


def test_the_scope_separates_tenants_loads_and_parameters() -> None:
    base = scope_key(ID, "acme", {})
    assert scope_key(ID, "globex", {}) != base
    assert scope_key(load_identity("m", 2, "default", b"files"), "acme", {}) != base
    assert scope_key(ID, "acme", {"p": 1}) != base
    assert scope_key(ID, "acme", {}) == base


GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def test_every_sampling_field_changes_the_generation_key() -> None:
    base = llm_key(ID, "acme", [1, 2, 3], GREEDY)
    changed = {
        "max_tokens": 9, "temperature": 0.5, "top_k": 4, "top_p": 0.5, "min_p": 0.1,
        "seed": 7, "stop": ("x",), "stop_token_ids": (5,), "ignore_eos": True,
        "min_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5,
        "repetition_penalty": 1.5, "logit_bias": ((1, 2.0),), "allowed_token_ids": (1, 2),
        "bad_words": ("no",), "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }  # fmt: skip
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    for name, value in changed.items():
        if name not in names:
            continue
        other = dataclasses.replace(GREEDY, **{name: value})
        assert llm_key(ID, "acme", [1, 2, 3], other) != base, name


def test_prompt_tenant_and_salt_change_the_generation_key() -> None:
    base = llm_key(ID, "acme", [1, 2, 3], GREEDY)
    assert llm_key(ID, "acme", [1, 2, 4], GREEDY) != base
    assert llm_key(ID, "acme", [1, 2], GREEDY) != base
    assert llm_key(ID, "globex", [1, 2, 3], GREEDY) != base
    assert llm_key(ID, "acme", [1, 2, 3], GREEDY, salt="s") != base
    assert llm_key(ID, "acme", [1, 2, 3], GREEDY) == base


def test_the_files_fingerprint_follows_the_config_and_the_files(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"weights")
    first = files_fingerprint(b"{}", tmp_path)
    assert files_fingerprint(b"{}", tmp_path) == first
    assert files_fingerprint(b'{"a":1}', tmp_path) != first
    (tmp_path / "model.onnx").write_bytes(b"other weights")
    assert files_fingerprint(b"{}", tmp_path) != first
