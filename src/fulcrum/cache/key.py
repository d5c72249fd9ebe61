"""Cache keys: blake2b-256 over everything that determines an answer, plus the tenant. Every
field is length-prefixed (no two requests concatenate to the same bytes) and tensors are hashed
from their own memory (no copy unless an array is not contiguous)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

import msgspec
import numpy as np

from fulcrum.types import Array, TensorMap

KEY_BYTES = 32
# Bumped when the key layout or the codec changes, so entries written by an older Fulcrum (in a
# shared Redis) are never read as if they were current.
KEY_FORMAT = b"fulcrum-cache-1"
_json = msgspec.json.Encoder(order="sorted")


class _Hasher:
    """blake2b-256 with length-prefixed fields."""

    def __init__(self, domain: bytes) -> None:
        self._h = hashlib.blake2b(digest_size=KEY_BYTES, person=domain[:16].ljust(16, b"\0"))
        self._h.update(KEY_FORMAT)

    def field(self, data: bytes | memoryview) -> None:
        self._h.update(len(data).to_bytes(8, "little"))
        self._h.update(data)

    def text(self, value: str) -> None:
        self.field(value.encode("utf-8", "surrogatepass"))

    def digest(self) -> bytes:
        return self._h.digest()


@dataclass(frozen=True, slots=True)
class LoadIdentity:
    """One loaded model version and variant, as the cache tells loads apart: a reload of the same
    version with other files or another config gets another identity, so old entries are never
    served for it (their keys are unreachable)."""

    model: str
    version: int
    variant: str
    digest: bytes  # blake2b of model, version, variant and the load's fingerprint


def load_identity(model: str, version: int, variant: str, fingerprint: bytes) -> LoadIdentity:
    h = _Hasher(b"load")
    h.text(model)
    h.field(str(version).encode())
    h.text(variant)
    h.field(fingerprint)
    return LoadIdentity(model, version, variant, h.digest())


def files_fingerprint(config_json: bytes, version_dir: Path) -> bytes:
    """The config plus each file's path, size and modification time under the version folder:
    cheap (no file is read), and replicas serving the same copy of a repository agree on it."""
    h = _Hasher(b"files")
    h.field(config_json)
    if version_dir.is_dir():
        for path in sorted(p for p in version_dir.rglob("*") if p.is_file()):
            stat = path.stat()
            h.text(path.relative_to(version_dir).as_posix())
            h.field(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.digest()


def tensor_key(
    identity: LoadIdentity, tenant: str, inputs: TensorMap, parameters: Mapping[str, object]
) -> bytes:
    """The exact-tier key of a batch model's request (inputs already in canonical shape)."""
    h = _Hasher(b"v2")
    h.field(identity.digest)
    h.text(tenant)
    h.field(_json.encode(dict(parameters)))
    for name in sorted(inputs):
        h.text(name)
        _hash_array(h, inputs[name])
    return h.digest()


def scope_key(identity: LoadIdentity, tenant: str, parameters: Mapping[str, object]) -> bytes:
    """The semantic tier's scope: a candidate is searched only among entries of the same load,
    tenant and parameters."""
    h = _Hasher(b"scope")
    h.field(identity.digest)
    h.text(tenant)
    h.field(_json.encode(dict(parameters)))
    return h.digest()


def llm_key(
    identity: LoadIdentity,
    tenant: str,
    token_ids: Sequence[int],
    sampling: object,
    *,
    salt: str = "",
) -> bytes:
    """The exact-tier key of a generation: the prompt's tokens and every sampling field (all of
    the dataclass's fields, so a field added later is in the key without a change here); `salt`
    is the request's `cache_salt`, which isolates its caching as it does the prefix cache's."""
    h = _Hasher(b"llm")
    h.field(identity.digest)
    h.text(tenant)
    h.text(salt)
    h.field(np.asarray(token_ids, dtype="<i8").tobytes())
    h.field(_json.encode(_sampling_fields(sampling)))
    return h.digest()


def _sampling_fields(sampling: object) -> dict[str, object]:
    if not is_dataclass(sampling) or isinstance(sampling, type):
        raise TypeError(f"sampling parameters must be a dataclass, got {type(sampling).__name__}")
    return {f.name: getattr(sampling, f.name) for f in fields(sampling)}


def _hash_array(h: _Hasher, arr: Array) -> None:
    h.field(np.asarray(arr.shape, dtype="<i8").tobytes())
    if arr.dtype.kind == "O":
        h.text("|bytes")
        _hash_objects(h, arr.ravel().tolist())
        return
    if arr.dtype.byteorder == ">":  # one key for one value, whatever the byte order it came in
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    h.text(arr.dtype.str)
    # A C-contiguous array is hashed from its own buffer: a 64 MiB request is not copied.
    data = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    h.field(data.data.cast("B") if data.size else b"")


def _hash_objects(h: _Hasher, items: Iterable[object]) -> None:
    for item in items:
        if isinstance(item, bytes | bytearray):
            h.field(bytes(item))
        else:
            h.text(str(item))
