"""Type stubs of the Rust extension module ``dcr._core`` (kept honest by
``python -m mypy.stubtest dcr._core`` in CI)."""

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, final

__all__ = [
    "BaseMismatchError",
    "CheckpointError",
    "ComposedDelta",
    "DeltaSink",
    "CorruptDeltaError",
    "DEFAULT_CHUNK_BYTES",
    "DcrError",
    "FORMAT_VERSION",
    "IncompleteDeltaError",
    "JournalError",
    "LayoutMismatchError",
    "OBJSTORE_SCHEMES",
    "ObjectStoreError",
    "UnsupportedFormatError",
    "VerificationError",
    "VersionChainError",
    "VersionExistsError",
    "__version__",
    "apply_changes",
    "apply_file",
    "apply_tensors",
    "block_digest",
    "checkpoint_files",
    "compare_files",
    "decode_delta",
    "delta_header",
    "diff_files",
    "diff_tensors",
    "digest_tensors",
    "file_digest",
    "find_changes",
    "inspect_file",
    "moved_digest",
    "publish_delta",
    "receive_delta",
    "relay_main",
    "scan_and_project",
    "sort_records",
    "tensor_digests",
    "TransportError",
    "objstore_gc",
    "objstore_publish",
    "objstore_publish_diff",
    "objstore_receive",
    "objstore_versions",
    "receiver_status",
    "refit_file",
]

__version__: str
FORMAT_VERSION: int
DEFAULT_CHUNK_BYTES: int

class DcrError(Exception): ...
class CorruptDeltaError(DcrError): ...
class IncompleteDeltaError(CorruptDeltaError): ...
class UnsupportedFormatError(CorruptDeltaError): ...
class BaseMismatchError(DcrError): ...
class LayoutMismatchError(DcrError): ...
class VerificationError(DcrError): ...
class CheckpointError(DcrError): ...
class JournalError(DcrError): ...
class TransportError(DcrError): ...
class ObjectStoreError(DcrError): ...
class VersionExistsError(ObjectStoreError): ...
class VersionChainError(BaseMismatchError): ...

_Span = tuple[int, int]

def diff_files(
    old: str | Any,
    new: str | Any,
    out: str | Any,
    *,
    chunk_bytes: int = ...,
    kind: str = "xor",
    zstd_level: int = 1,
    mode: str = "free",
    base_version: int = 0,
    target_version: int = 1,
    dense: bool = False,
    threads: int | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> dict[str, Any]: ...
def apply_file(delta: str | Any, target: str | Any, *, threads: int | None = None) -> dict[str, Any]: ...
def compare_files(a: str | Any, b: str | Any) -> list[str]: ...
def inspect_file(path: str | Any) -> dict[str, Any]: ...
def file_digest(path: str | Any) -> str: ...
def checkpoint_files(path: str | Any) -> list[Path]: ...
def diff_tensors(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    chunk_bytes: int = ...,
    kind: str = "xor",
    zstd_level: int = 1,
    mode: str = "free",
    base_version: int = 0,
    target_version: int = 1,
    threads: int | None = None,
    base_digests: Mapping[str, Any] | None = None,
) -> tuple[bytes, dict[str, Any]]: ...
def apply_tensors(
    delta: bytes,
    tensors: Mapping[str, Any],
    *,
    threads: int | None = None,
    base_digests: Mapping[str, Any] | None = None,
) -> dict[str, Any]: ...
def digest_tensors(tensors: Mapping[str, Any]) -> str: ...
def tensor_digests(tensors: Mapping[str, Any]) -> dict[str, bytes]: ...
def find_changes(old: _Span, new: _Span, width: int, kind: str = "xor") -> tuple[bytes, bytes]: ...
def apply_changes(target: _Span, width: int, positions: bytes, values: bytes, kind: str = "xor") -> None: ...
def block_digest(
    local: _Span,
    dtype: str,
    local_offset: int,
    shape: list[int],
    canonical_offset: int,
    canonical_strides: list[int],
) -> bytes: ...
def moved_digest(dtype: str, elements: bytes, old: bytes, new: bytes) -> bytes: ...
def scan_and_project(
    old: _Span,
    new: _Span,
    dtype: str,
    first_local: int,
    tensors: list[int],
    local_offsets: list[int],
    shapes: list[list[int]],
    canonical_offsets: list[int],
    canonical_strides: list[list[int]],
) -> tuple[bytes, list[tuple[int, bytes]], bytes, bytes]: ...
def sort_records(parts: list[_Span], chunk_words: list[int], first_chunk: list[int]) -> tuple[bytes, bytes]: ...

@final
class ComposedDelta:
    def __new__(
        cls,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        base_digests: list[bytes],
        target_digests: list[bytes],
        *,
        chunk_bytes: int,
        base_version: int,
        target_version: int,
        mode: str = "free",
    ) -> ComposedDelta: ...
    def header_blob(self) -> bytes: ...
    @property
    def base_digest(self) -> str: ...
    @property
    def target_digest(self) -> str: ...
    @property
    def delta_id(self) -> str: ...
    def chunk_words(self, tensor: int) -> int: ...
    def chunk_frame(
        self, seq: int, tensor: int, start: int, positions: bytes, xor: bytes, *, zstd_level: int = 1
    ) -> bytes: ...
    def context_chunk_frame(
        self,
        seq: int,
        tensor: int,
        start: int,
        base: tuple[int, int],
        positions: bytes,
        xor: bytes,
        *,
        zstd_level: int = 1,
    ) -> bytes: ...
    def trailer_frame(self, n_chunks: int, n_changed: int) -> bytes: ...

@final
class DeltaSink:
    @staticmethod
    def file(path: str | Any) -> DeltaSink: ...
    @staticmethod
    def relay(
        to: str,
        version: int,
        *,
        key_file: str | Any | None = None,
        standby: list[str] = ...,
        expect_acks: int = 0,
        ack_timeout_s: float = 120.0,
    ) -> DeltaSink: ...
    @staticmethod
    def object_store(url: str, *, version: int | None = None, concurrency: int = ...) -> DeltaSink: ...
    def write(self, blob: bytes) -> None: ...
    def finish(self) -> dict[str, Any]: ...
    def abort(self) -> None: ...

def decode_delta(
    delta: bytes, base: Callable[[str], tuple[int, int]] | None = None
) -> tuple[dict[str, Any], list[tuple[str, int, int, str, bytes, bytes]]]: ...
def delta_header(delta: bytes) -> dict[str, Any]: ...
def publish_delta(
    delta: str | Any,
    to: str,
    *,
    key_file: str | Any | None = None,
    version: int | None = None,
    expect_acks: int = 0,
    ack_timeout_s: float = 120.0,
    standby: list[str] = ...,
    progress: Callable[[int, int], object] | None = None,
) -> dict[str, Any]: ...
def receive_delta(
    target: str | Any,
    parents: list[str],
    *,
    key_file: str | Any | None = None,
    receiver_id: str | None = None,
    from_version: int = 0,
    timeout_s: float = 600.0,
    progress: Callable[[int, int], object] | None = None,
    journal: str | Any | None = None,
    journaled: bool = True,
    batch_chunks: int = 256,
) -> dict[str, Any]: ...
def relay_main(argv: list[str]) -> int: ...

# ---- object storage (issue 8; docs/objstore.md)
OBJSTORE_SCHEMES: list[str]

def objstore_publish(
    delta: str | Any,
    url: str,
    *,
    version: int | None = None,
    concurrency: int = ...,
    multipart_bytes: int = ...,
    part_bytes: int = ...,
    commit: bool = True,
    progress: Callable[[int, int], object] | None = None,
) -> dict[str, Any]: ...
def objstore_publish_diff(
    old: str | Any,
    new: str | Any,
    url: str,
    *,
    version: int | None = None,
    chunk_bytes: int = ...,
    kind: str = "xor",
    zstd_level: int = 1,
    concurrency: int = ...,
    multipart_bytes: int = ...,
    part_bytes: int = ...,
    commit: bool = True,
    threads: int | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> dict[str, Any]: ...
def objstore_receive(
    target: str | Any,
    url: str,
    *,
    receiver_id: str | None = None,
    wait: float = 0.0,
    poll: float = 0.2,
    concurrency: int = ...,
    progress: Callable[[str, int, int, int], object] | None = None,
    journal: str | Any | None = None,
) -> dict[str, Any]: ...
def objstore_versions(url: str) -> list[dict[str, Any]]: ...
def objstore_gc(url: str, *, dry_run: bool = False) -> dict[str, Any]: ...
# ------------------------------------------------------------ resumable receiver (issue 3)

def refit_file(
    delta: str | Any,
    target: str | Any,
    *,
    journal: str | Any | None = None,
    batch_chunks: int = 256,
    threads: int | None = None,
) -> dict[str, Any]: ...
def receiver_status(target: str | Any, *, journal: str | Any | None = None) -> dict[str, Any]: ...
