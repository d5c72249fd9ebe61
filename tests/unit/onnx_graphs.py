"""Tiny ONNX graphs the unit tests build on the fly."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx.helper as oh


def write_add_graph(path: Path) -> None:
    """x (float [B, 2]) -> y = x + x."""
    graph = oh.make_graph(
        [oh.make_node("Add", ["x", "x"], ["y"])],
        "double",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", 2])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", 2])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
