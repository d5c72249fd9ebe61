"""Model variants: precisions (or builds) of one model declared in its `config.toml`.

```toml
default_variant = "fp32"
[variants.fp32]
parameters = { model_file = "model.onnx" }
[variants.int8]
precision = "int8"
parameters = { model_file = "model.int8.onnx" }
[variants.int8.figures]          # written by `fulcrum quantize`
fidelity = 0.998
```

A variant is the model's config with the variant's `parameters` laid over the model's own; all
else (inputs, batching, instances) is shared. A model that declares none has one implicit variant,
`default`. The repository loads every variant whose `load` is true; a request names one with the
`variant` parameter (v2) or the `X-Fulcrum-Variant` header, else the default serves it.
"""

from __future__ import annotations

import msgspec

from fulcrum.config import ModelConfig, Variant
from fulcrum.errors import ConfigError

IMPLICIT_VARIANT = "default"


def variant_names(config: ModelConfig) -> list[str]:
    """Every declared variant in file order, or the implicit one."""
    return list(config.variants) or [IMPLICIT_VARIANT]


def loaded_variant_names(config: ModelConfig) -> list[str]:
    """The variants the repository loads (declared with `load = true`), in file order."""
    if not config.variants:
        return [IMPLICIT_VARIANT]
    return [name for name, v in config.variants.items() if v.load]


def default_variant(config: ModelConfig) -> str:
    """The variant that serves a request that names none."""
    if config.default_variant:
        return config.default_variant
    return loaded_variant_names(config)[0]


def resolve_variant(config: ModelConfig, name: str | None = None) -> ModelConfig:
    """`config` as variant `name` (None: the default) runs it: the variant's parameters laid over
    the model's. ConfigError names the known variants when `name` is not one of them."""
    chosen = default_variant(config) if name is None else name
    if not config.variants:
        if chosen != IMPLICIT_VARIANT:
            raise ConfigError(
                f"model '{config.name}' has no variant {chosen!r} (variants: ['default'])"
            )
        return config
    variant: Variant | None = config.variants.get(chosen)
    if variant is None:
        raise ConfigError(
            f"model '{config.name}' has no variant {chosen!r} (variants: {variant_names(config)})"
        )
    return msgspec.structs.replace(config, parameters={**config.parameters, **variant.parameters})
