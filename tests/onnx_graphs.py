"""Tiny ONNX graphs the tests build on the fly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh


def write_matmul_graph(path: Path, weights: np.ndarray) -> None:
    """y = x @ weights, x and y float [B, width]: each row's answer is its own."""
    width = weights.shape[0]
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["y"])],
        "matmul",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", width])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", weights.shape[1]])],
        [onnx.numpy_helper.from_array(weights, "w")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


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
