"""shared_weights reads a model file's embedding tables, and nothing else, from the protobuf."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import pytest

from fulcrum.backends.onnx_weights import MIN_SHARED_BYTES, shared_weights


def save(
    path: Path,
    nodes: list[onnx.NodeProto],
    tensors: dict[str, np.ndarray],
    *,
    inputs: tuple[str, ...] = ("ids",),
    external: bool = False,
) -> None:
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info(name, onnx.TensorProto.INT64, None) for name in inputs],
        [oh.make_tensor_value_info(n.output[0], onnx.TensorProto.FLOAT, None) for n in nodes],
        initializer=[onnx.numpy_helper.from_array(a, name) for name, a in tensors.items()],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=external, size_threshold=1024)


def table(rows: int = 512, dtype: type[np.generic] = np.float32) -> np.ndarray:
    return np.arange(rows * 64).reshape(rows, 64).astype(dtype)


def test_a_table_read_only_by_gathers_is_shared_with_its_values(tmp_path: Path) -> None:
    words, halves = table(), table(dtype=np.float16)
    nodes = [
        oh.make_node("Gather", ["words", "ids"], ["a"]),
        oh.make_node("Gather", ["words", "ids"], ["b"]),
        oh.make_node("Gather", ["halves", "ids"], ["c"]),
    ]
    save(tmp_path / "m.onnx", nodes, {"words": words, "halves": halves})
    found = shared_weights(tmp_path / "m.onnx")
    assert sorted(found) == ["halves", "words"]
    assert found["words"].dtype == np.float32 and np.array_equal(found["words"], words)
    assert found["halves"].dtype == np.float16 and np.array_equal(found["halves"], halves)
    assert found["words"].flags.owndata  # a copy of its own, not a view of the file's bytes


def test_weights_a_matmul_reads_are_left_to_ort(tmp_path: Path) -> None:
    # ORT pre-packs a MatMul's constant weight into a per-session copy: sharing the original
    # would keep one more copy. A table tied to a MatMul (an LM head) is left alone too.
    nodes = [
        oh.make_node("Gather", ["tied", "ids"], ["a"]),
        oh.make_node("MatMul", ["a", "tied_t"], ["b"]),
        oh.make_node("MatMul", ["a", "tied"], ["c"]),
    ]
    tied = table(64)
    save(tmp_path / "m.onnx", nodes, {"tied": tied, "tied_t": table(64)})
    assert shared_weights(tmp_path / "m.onnx") == {}


def test_small_external_and_overridable_tensors_are_left_to_ort(tmp_path: Path) -> None:
    small = table(rows=MIN_SHARED_BYTES // (64 * 4) - 1)
    nodes = [
        oh.make_node("Gather", ["small", "ids"], ["a"]),
        oh.make_node("Gather", ["fed", "ids"], ["b"]),
    ]
    # "fed" is a graph input too: a request may override it, so it is not a constant.
    save(tmp_path / "m.onnx", nodes, {"small": small, "fed": table()}, inputs=("ids", "fed"))
    assert shared_weights(tmp_path / "m.onnx") == {}
    save(tmp_path / "x.onnx", [oh.make_node("Gather", ["big", "ids"], ["a"])], {"big": table()},
         external=True)  # fmt: skip
    assert shared_weights(tmp_path / "x.onnx") == {}


def test_a_file_that_is_not_protobuf_raises(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"\x0f" * 16)  # wire type 7 does not exist
    with pytest.raises(ValueError, match="wire type"):
        shared_weights(path)
