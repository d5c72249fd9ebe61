"""Which ONNX Runtime execution providers a model runs on, and opening its sessions on them.

By default a model runs on CUDA where this onnxruntime has the CUDA provider (the
`onnxruntime-gpu` wheel), else on the CPU; `execution_providers` in `[parameters]` names them
instead. ORT's CUDA provider loads CUDA and cuDNN at session creation, and when those libraries
come from pip's `nvidia-*` wheels it does not look for them there unless asked
(`onnxruntime.preload_dlls`, which an `import torch` built for the same CUDA also does). When
they are missing ORT logs an error and runs the session on the CPU anyway: a model then serves
at a fraction of the speed its user planned for, without a word. So the session's providers are
read back: a model that named CUDA fails to load with the reason, and one that was given CUDA
by default loads on the CPU with a warning that says why.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import threading
from pathlib import Path

import onnxruntime as ort

from fulcrum.errors import ConfigError, ModelError
from fulcrum.parameters import OnnxParameters

logger = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of its warnings
_preload_lock = threading.Lock()
_preload_report: str | None = None  # what preloading printed, once it has run


def execution_providers(params: OnnxParameters) -> list[str]:
    """The configured providers, or CUDA (when this onnxruntime has it) then CPU."""
    available = ort.get_available_providers()
    default = [p for p in (CUDA, CPU) if p in available]
    chosen = params.execution_providers
    providers = default if chosen is None else list(chosen)
    missing = [p for p in providers if p not in available]
    if missing or not providers:
        raise ConfigError(
            f"parameter 'execution_providers' = {providers!r}: not available here "
            f"(available: {available})"
        )
    return providers


def open_session(
    name: str,
    path: Path,
    options: ort.SessionOptions,
    providers: list[str],
    *,
    required: bool,
) -> ort.InferenceSession:
    """A session over `path` on `providers`; `required`: the user named them, so a CUDA
    provider that does not start is an error rather than a warning."""
    report = _preload_cuda() if CUDA in providers else ""
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # ORT raises its own untyped errors for a bad graph
        raise ModelError(f"model {name!r}: cannot load {path}: {exc}") from exc
    running = session.get_providers()
    if CUDA in providers and CUDA not in running:
        why = f" ({report})" if report else ""
        message = (
            f"model {name!r}: ONNX Runtime could not start {CUDA}, so the model would run on "
            f"{running}: its CUDA or cuDNN libraries did not load{why}; install onnxruntime-gpu "
            "with the CUDA and cuDNN it was built for"
        )
        if required:
            raise ModelError(f"{message}, or set execution_providers = [{CPU!r}]")
        logger.warning("%s; serving on the CPU", message)
    return session


def _preload_cuda() -> str:
    """Load the CUDA and cuDNN libraries of pip's `nvidia-*` wheels once per process; returns
    what ORT printed while doing so (the libraries that failed), for the error above."""
    global _preload_report
    with _preload_lock:
        if _preload_report is None:
            printed = io.StringIO()
            preload = getattr(ort, "preload_dlls", None)  # ORT 1.21 and later
            with contextlib.redirect_stdout(printed):
                try:
                    if preload is not None:
                        preload()
                except Exception as exc:  # it raises on a bad directory; report, load anyway
                    print(f"{type(exc).__name__}: {exc}")
            _preload_report = " ".join(_ANSI.sub("", printed.getvalue()).split())
        return _preload_report
