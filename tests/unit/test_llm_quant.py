"""Int8 weight-only LLM layers, their checkpoint, the engine loading it from a variant's
parameters, the LLM quantizer's fidelity figures, and per-engine torch threads."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import msgspec
import pytest

torch = pytest.importorskip("torch")

from fulcrum.config import load_model_config  # noqa: E402
from fulcrum.errors import ConfigError  # noqa: E402
from fulcrum.llm import quant  # noqa: E402
from fulcrum.llm.loader import load_checkpoint  # noqa: E402
from fulcrum.llm.params import EngineParams  # noqa: E402
from fulcrum.llm.sampling_params import SamplingParams  # noqa: E402
from fulcrum.llm.sync_engine import LLMEngine  # noqa: E402
from fulcrum.llm.threads import PER_THREAD, pin_num_threads  # noqa: E402
from fulcrum.tuning.config_file import edit_config, set_values, set_variant  # noqa: E402
from fulcrum.tuning.profile import ProfileOptions  # noqa: E402
from fulcrum.tuning.quantize import QuantizeJob, VariantFile, quantizer_for  # noqa: E402
from fulcrum.tuning.quantize_llm import INT8_FILE, LlmFidelityOptions, LlmQuantizer  # noqa: E402
from fulcrum.tuning.validation_set import ValidationSet  # noqa: E402
from fulcrum.variants import resolve_variant  # noqa: E402

# Random-weight tiny models have nearly flat logits (perplexity near the vocabulary size), so
# near-ties flip under any rounding: 0.94 measured here (worst prompt 0.875). A broken int8
# path (wrong scales, transposed weights) agrees at chance, about 1/512.
MIN_AGREEMENT = 0.8
FAST = LlmFidelityOptions(num_prompts=4, continuation_tokens=16, max_chunks=2)


@pytest.fixture(scope="module")
def llama_dir(example_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of tiny-llama (the quantizer writes into its version folder)."""
    target = tmp_path_factory.mktemp("quant") / "tiny-llama"
    shutil.copytree(example_repo / "tiny-llama", target)
    return target


@pytest.fixture(scope="module")
def written(llama_dir: Path) -> tuple[QuantizeJob, VariantFile]:
    """tiny-llama quantized once for the module: the job and what the quantizer wrote."""
    config = load_model_config(llama_dir / "config.toml", dir_name="tiny-llama")
    ref = msgspec.structs.replace(
        config, parameters={**config.parameters, "model_file": "model.safetensors"}
    )
    job = QuantizeJob(ref, "fp32", llama_dir / "1", ValidationSet({}, None, "corpus"), 0.9, "auto")
    return job, LlmQuantizer(FAST).write(job, "int8")


# --- the layer ----------------------------------------------------------------------------


def test_quantize_dequantize_round_trip_is_within_half_a_step() -> None:
    weight = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0  # an all-zero channel must stay zero, not divide by zero
    q, scale = quant.quantize_weight(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    error = (quant.dequantize_weight(q, scale) - weight).abs()  # (N, K)
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())
    assert bool((q[3] == 0).all())
    # Each channel's largest weight maps to +-127 exactly (per-channel, symmetric).
    assert bool((q.abs().amax(dim=1)[weight.abs().amax(dim=1) > 0] == 127).all())


@pytest.mark.parametrize("bf16", [True, False])  # float32 inputs computed in bf16, or not
@pytest.mark.parametrize("num_rows", [1, 5, 39])
@pytest.mark.parametrize("max_rows", [None, 4])  # None: fused for every row count (shipped)
def test_int8_linear_matches_the_float_layer_within_the_quantization_error(
    num_rows: int, bf16: bool, max_rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if bf16 and not quant.cpu_has_bf16():
        pytest.skip("this CPU has no native bfloat16")
    monkeypatch.setattr(quant, "cpu_has_bf16", lambda: bf16)
    monkeypatch.setattr(quant, "FUSED_MAX_ROWS", max_rows)  # 4: 5 and 39 rows dequantize
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen) * 0.1)
        linear.bias.copy_(torch.randn(40, generator=gen))
    layer = quant.Int8Linear.from_linear(linear)
    x = torch.randn(2, num_rows, 96, generator=gen)  # a leading batch axis too
    with torch.inference_mode():
        got = layer(x)
        want = linear(x)
    assert got.shape == want.shape == (2, num_rows, 40)
    # |x . (w - w_q)| <= sum |x| * scale / 2; bf16 compute adds a rounding of about 2^-8 of
    # sum |x * w| (inputs and outputs rounded once each).
    magnitude = x.abs() @ linear.weight.abs().t()  # (2, M, N)
    rounding = magnitude * 2**-7 if bf16 else magnitude * 1e-6
    bound = x.abs().sum(-1, keepdim=True) * layer.weight_scale / 2 + rounding + 1e-5
    assert bool(((got - want).abs() <= bound).all())
    assert float((got - want).abs().max()) > 0  # it really is a different (int8) layer


def test_projections_are_quantized_and_the_head_tied_or_not_when_asked(
    example_repo: Path,
) -> None:
    llama = load_checkpoint(example_repo / "tiny-llama" / "1").model
    names = quant.quantizable_linears(llama)  # type: ignore[arg-type]
    assert "lm_head" not in names and len(names) == 2 * 7  # q k v o gate up down per layer
    assert "lm_head" in quant.quantizable_linears(llama, include_lm_head=True)  # type: ignore[arg-type]
    gpt2 = load_checkpoint(example_repo / "tiny-gpt2" / "1").model  # its head is tied
    assert "lm_head" in quant.quantizable_linears(gpt2, include_lm_head=True)  # type: ignore[arg-type]


# --- the checkpoint and the engine --------------------------------------------------------


def test_the_int8_file_is_smaller_marked_and_loads_as_int8_layers(
    written: tuple[QuantizeJob, VariantFile],
) -> None:
    job, variant = written
    path = job.version_dir / INT8_FILE
    assert variant.files == (path,)
    assert variant.parameters == {"model_file": INT8_FILE, "quantization": "int8"}
    assert quant.file_quantization(path) == "int8"
    # The projections and the head shrink 4x; tiny-llama's float input embedding is a fifth of
    # its weights (0.42 of the float file here; 0.56 when the head stayed float).
    assert path.stat().st_size < 0.45 * (job.version_dir / "model.safetensors").stat().st_size
    model = load_checkpoint(job.version_dir, model_file=INT8_FILE).model
    layer = model.model.layers[0].self_attn.q_proj  # type: ignore[attr-defined]
    assert isinstance(layer, quant.Int8Linear) and layer.weight.dtype == torch.int8
    assert isinstance(model.lm_head, quant.Int8Linear)  # type: ignore[attr-defined]
    assert model.model.embed_tokens.weight.dtype == torch.float32  # type: ignore[attr-defined]


def test_the_float_weights_still_load_with_the_int8_file_beside_them(
    written: tuple[QuantizeJob, VariantFile],
) -> None:
    job, _ = written
    model = load_checkpoint(job.version_dir).model  # model_file "": every float file
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("model_file", "quantization"), [("model.safetensors", "int8"), (INT8_FILE, "none")]
)
def test_a_weights_file_that_contradicts_the_quantization_key_is_refused(
    written: tuple[QuantizeJob, VariantFile], model_file: str, quantization: str
) -> None:
    job, _ = written
    params = EngineParams(model_file=model_file, quantization=quantization, device="cpu")
    with pytest.raises(ConfigError, match=r"key 'parameters\.quantization'"):
        LLMEngine.from_checkpoint(job.version_dir, params)


@pytest.mark.parametrize(
    ("parameters", "key"),
    [
        ({"model_file": "../other/model.safetensors"}, "model_file"),
        ({"model_file": "model.bin"}, "model_file"),
        ({"quantization": "int3"}, "quantization"),
        ({"num_threads": -1}, "num_threads"),
    ],
)
def test_bad_weight_and_thread_parameters_name_their_key(
    parameters: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError, match=rf"key 'parameters\.{key}'"):
        EngineParams.from_parameters(parameters)


def test_a_missing_weights_file_names_the_key(written: tuple[QuantizeJob, VariantFile]) -> None:
    job, _ = written
    with pytest.raises(ConfigError, match=r"key 'parameters\.model_file' = 'gone.safetensors'"):
        load_checkpoint(job.version_dir, model_file="gone.safetensors")


def test_the_engine_serves_the_int8_variant_from_its_config(
    llama_dir: Path, written: tuple[QuantizeJob, VariantFile]
) -> None:
    _, variant = written
    path = llama_dir / "config.toml"

    def declare(document: object) -> None:
        set_values({"default_variant": "fp32"})(document)  # type: ignore[arg-type]
        set_variant("fp32", parameters={"model_file": "model.safetensors"})(document)  # type: ignore[arg-type]
        set_variant("int8", parameters=variant.parameters, precision="int8")(document)  # type: ignore[arg-type]

    config = edit_config(path, declare).config
    tokens = {}
    for name in ("fp32", "int8"):
        params = EngineParams.from_parameters(dict(resolve_variant(config, name).parameters))
        engine = LLMEngine.from_checkpoint(llama_dir / "1", params)
        engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0.0))
        out: list[int] = []
        while engine.has_unfinished():
            out.extend(t for o in engine.step() for t in o.new_token_ids)
        tokens[name] = out
        layer = engine.runner.model.model.layers[0].mlp.up_proj  # type: ignore[attr-defined]
        assert isinstance(layer, quant.Int8Linear) is (name == "int8")
    assert len(tokens["int8"]) == len(tokens["fp32"]) > 0


# --- fidelity and speed figures -------------------------------------------------------------


def test_quantizer_reports_agreement_and_perplexity_ratio(
    written: tuple[QuantizeJob, VariantFile],
) -> None:
    _, variant = written
    assert variant.fidelity is not None and variant.fidelity.metric == "token_agreement"
    assert MIN_AGREEMENT <= variant.fidelity.value <= 1.0
    assert any("teacher-forced" in n for n in variant.notes)
    ratio_note = next(n for n in variant.notes if n.startswith("perplexity ratio"))
    assert 0.95 < float(ratio_note.split()[2]) < 1.05


def test_a_variant_identical_to_the_reference_agrees_exactly(
    written: tuple[QuantizeJob, VariantFile],
) -> None:
    job, _ = written
    same = LlmQuantizer(FAST).fidelity(job, job.config)
    assert same.value == 1.0 and same.worst_row == 1.0


def test_quantizer_measures_both_speeds_at_a_fixed_concurrency(
    written: tuple[QuantizeJob, VariantFile],
) -> None:
    job, _ = written
    options = ProfileOptions(batch_sizes=(2,), warmup=0, repeats=1)
    speed = LlmQuantizer(FAST).measure(job, job.config, options)
    assert speed.knee_batch == 2
    assert speed.latency_ms is not None and speed.latency_ms > 0 and speed.throughput_rps > 0


def test_quantize_dispatches_llm_models_to_this_quantizer() -> None:
    assert isinstance(quantizer_for("llm"), LlmQuantizer)


# --- threads --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> object:
    # Setting a count also sets the value new threads start with: leave it as it was.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not PER_THREAD, reason="torch's native thread pool has one count")
def test_two_threads_hold_different_torch_thread_counts() -> None:
    counts: dict[int, int] = {}
    pinned = threading.Barrier(2)
    ran = threading.Barrier(2)

    def work(num_threads: int) -> None:
        pin_num_threads(num_threads)
        pinned.wait()  # both have set theirs before either runs an op
        x = torch.randn(64, 64)
        (x @ x).sum()  # an op runs torch's lazy per-thread init: it must not undo the pin
        ran.wait()
        counts[num_threads] = torch.get_num_threads()

    threads = [threading.Thread(target=work, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts == {1: 1, 2: 2}


@pytest.mark.skipif(not PER_THREAD, reason="torch's native thread pool has one count")
def test_an_engine_pins_its_thread_count_on_the_thread_that_steps_it(
    example_repo: Path,
) -> None:
    main_before = torch.get_num_threads()
    params = EngineParams(num_threads=1, device="cpu", kv_cache_memory_mb=4)
    engine = LLMEngine.from_checkpoint(example_repo / "tiny-llama" / "1", params)
    seen: list[int] = []

    def drive() -> None:
        torch.set_num_threads(2)  # what another model's setting would leave behind
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == main_before
