"""Load a Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer.json and the
tokenizer/generation configs (eos ids, chat template). Safetensors only: pickle is never read.
A `fulcrum quantize` file (`model.int8.safetensors`, `model.int4.safetensors`) is read only when
`model_file` names it; AWQ / GPTQ int4 checkpoints are read by `quant_formats`. The model is
built on the meta device and each tensor is read from its file straight into its final memory
(a quantized layer's into its int8 / int4 buffers): a load peaks near what the model keeps."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch.overrides import TorchFunctionMode

from fulcrum.errors import ConfigError
from fulcrum.llm import quant, quant_formats
from fulcrum.llm.models import CausalLM, build_model
from fulcrum.llm.weight_file import WeightFile

# Non-parameter tensors some checkpoints carry (causal-mask and RoPE buffers); recomputed here.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedLLM:
    """A model ready to run, its tokenizer, and what the checkpoint says about generation."""

    model: CausalLM
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token / eos_token strings, for the chat template
    max_model_len: int
    # Salt for the prefix cache given a prompt's token count: set where the model's K/V depend
    # on the prompt's length (dynamic / longrope RoPE beyond the trained length), else None.
    prefix_cache_key: Callable[[int], str | None] = lambda num_prompt_tokens: None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from disk, or ConfigError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def load_checkpoint(
    directory: Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    model_file: str = "",
    quantization: str = "auto",
) -> LoadedLLM:
    """Build the model for `directory/config.json` and fill it from `model_file` ("": every
    float *.safetensors file, as sharded checkpoints need); `quantization` ("auto": whatever the
    file's metadata says) must match the file."""
    if dtype not in DTYPES:
        raise ConfigError(f"key 'dtype' = {dtype!r}: expected one of {sorted(DTYPES)}")
    raw_config = read_json(directory / "config.json")
    module = build_empty(raw_config)
    model: CausalLM = module  # type: ignore[assignment]
    files, found = weight_files(directory, model_file)
    external = quant_formats.external_format(raw_config)  # AWQ / GPTQ int4, else None
    found = quant.INT4 if external is not None else found
    if quantization not in ("auto", found):
        raise ConfigError(
            f"key 'parameters.quantization' = {quantization!r}: {files[0].name} holds {found!r} "
            f"weights (its {quant.QUANT_KEY!r} metadata); check key 'parameters.model_file'"
        )
    if external is not None:
        quant_formats.load_external(module, model, files, external, DTYPES[dtype])
    else:
        _load_weights(module, model, files, quantized=found != quant.NONE, dtype=DTYPES[dtype])
    module.to(dtype=DTYPES[dtype], device=torch.device(device)).eval()
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ConfigError(f"{directory}: no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tok_config = _optional_json(directory / "tokenizer_config.json")
    gen_config = _optional_json(directory / "generation_config.json")
    return LoadedLLM(
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(gen_config, raw_config, tok_config, tokenizer),
        chat_template=_chat_template(tok_config),
        special_tokens={
            key: _token_text(tok_config.get(key))
            for key in ("bos_token", "eos_token")
            if tok_config.get(key)
        },
        max_model_len=model.max_model_len,
        prefix_cache_key=_prefix_cache_key(module),
    )


class _SkipInit(TorchFunctionMode):
    """Drops the in-place initialisation of meta tensors (`nn.init.normal_`, `uniform_`):
    there is nothing to fill, and torch runs those through its Python references, whose first
    use imports torch._dynamo and sympy (about 80 MB resident for good)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else kwargs.get("tensor")
        in_place = name.endswith("_") and not name.endswith("__")
        if in_place and isinstance(first, torch.Tensor) and first.is_meta:
            return first
        return func(*args, **kwargs)


def build_empty(raw_config: dict[str, Any]) -> torch.nn.Module:
    """The model for `raw_config` with its parameters on the meta device (no memory, no
    initialisation): a quantized layer replaces its float shell before any is allocated, and
    `materialize` then gives the rest memory the checkpoint fills. Computed buffers (RoPE
    tables) are real. The device context and the mode are this thread's only."""
    with torch.device("meta"), _SkipInit():
        return build_model(raw_config)


def _prefix_cache_key(module: torch.nn.Module) -> Callable[[int], str | None]:
    from fulcrum.llm.models.llama import LlamaForCausalLM

    if isinstance(module, LlamaForCausalLM):
        return module.prefix_cache_key
    return lambda num_prompt_tokens: None


def weight_files(directory: Path, model_file: str) -> tuple[list[Path], str]:
    """The files to read and what they hold ("none": float, or "int8")."""
    if model_file:
        path = directory / model_file
        if not path.is_file():
            raise ConfigError(
                f"key 'parameters.model_file' = {model_file!r}: no such file in {directory}"
            )
        return [path], quant.file_quantization(path)
    # A quantized file sits next to the float weights it came from: never mix it in.
    files = [
        path
        for path in sorted(directory.glob("*.safetensors"))
        if quant.file_quantization(path) == quant.NONE
    ]
    if not files:
        raise ConfigError(f"{directory}: no *.safetensors weights (pickle files are refused)")
    return files, quant.NONE


def _load_weights(
    module: torch.nn.Module,
    model: CausalLM,
    files: list[Path],
    *,
    quantized: bool,
    dtype: torch.dtype,
) -> None:
    if quantized:  # quantized layers first, so their buffers are there to be filled by name
        quant.install_shells(module, files[0])
    materialize(module, dtype)
    params = quant.loadable_tensors(module)
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with WeightFile(file) as handle:
                for key in handle.names():
                    if key.endswith(_IGNORED_SUFFIXES):
                        continue
                    # Quantized files hold our own names and (out, in) layout already.
                    name = key if quantized else model.checkpoint_name(key)
                    if name not in params:
                        raise ConfigError(f"{file}: unexpected weight {key!r}")
                    transposed = name.endswith(model.transposed_weights)
                    transposed = transposed and not quantized and name != "lm_head.weight"
                    fill(params[name], handle, key, transposed=transposed)
                    loaded.add(name)
    # A tied head shares its tensor with the embedding, so named_parameters lists it once.
    missing = sorted(set(params) - loaded)
    if missing:
        names = ", ".join(f.name for f in files)
        raise ConfigError(f"{names}: weights missing from the checkpoint: {missing[:5]}")


def materialize(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every parameter still on the meta device CPU memory of `dtype`, uninitialised (the
    checkpoint fills it); a tied parameter stays one tensor."""
    made: dict[int, torch.nn.Parameter] = {}
    for child in module.modules():
        for name, param in list(child.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            real = made.get(id(param))
            if real is None:
                empty = torch.empty(param.shape, dtype=dtype, device="cpu")
                real = made[id(param)] = torch.nn.Parameter(empty, param.requires_grad)
            setattr(child, name, real)


def fill(param: torch.Tensor, handle: WeightFile, key: str, *, transposed: bool = False) -> None:
    """Copy tensor `key` (stored transposed when `transposed`) into `param`: read in place
    when its dtype and layout allow, else through one tensor-sized buffer."""
    entry = handle.entry(key)
    shape = entry.shape[::-1] if transposed else entry.shape
    if tuple(param.shape) != shape:
        raise ConfigError(
            f"{handle.path}: weight {key!r} has shape {list(shape)}, expected {list(param.shape)}"
        )
    in_place = param.dtype == entry.dtype and param.is_contiguous() and param.device.type == "cpu"
    if in_place and (not transposed or param.dim() < 2):
        handle.read_into(key, param)
        return
    tensor = handle.read(key)
    param.copy_((tensor.t() if transposed else tensor).to(param.dtype))


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _token_text(token: Any) -> str:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    return str(token.get("content", "")) if isinstance(token, dict) else str(token)


def _eos_ids(
    gen_config: dict[str, Any],
    raw_config: dict[str, Any],
    tok_config: dict[str, Any],
    tokenizer: Tokenizer,
) -> tuple[int, ...]:
    value = gen_config.get("eos_token_id", raw_config.get("eos_token_id"))
    if value is None and tok_config.get("eos_token"):
        value = tokenizer.token_to_id(_token_text(tok_config["eos_token"]))
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _chat_template(tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
