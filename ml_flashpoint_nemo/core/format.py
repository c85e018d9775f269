"""Format v1: the bytes of object headers, object indexes and commit records.

docs/format.md is the specification; this module is its only implementation.
Nothing here pickles: headers are fixed binary structs, indexes and commit
records are UTF-8 JSON protected by CRC32C.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.errors import CorruptCheckpointError, FormatVersionError

FORMAT_VERSION = 1
OBJECT_MAGIC = b"MLFPOBJ\x00"
COMMIT_MAGIC = "ml_flashpoint_nemo/commit"
HEADER_NBYTES = 64
RECORD_ALIGNMENT = 64
LARGE_RECORD_ALIGNMENT = 4096  # records of at least LARGE_RECORD_BYTES start on a page
LARGE_RECORD_BYTES = 1 << 20
FLAG_NO_DATA_CRC = 1  # written with checksums off: record CRC32C fields are 0 and not checked
FLAG_ZERO_PADDING = 2  # every byte outside the header, the records and the index is zero

# magic, format_version, header_nbytes, object_nbytes, index_offset, index_nbytes,
# index_crc32c, record_count, writer_rank, flags, reserved; header_crc32c follows.
_HEADER = struct.Struct("<8sIIQQQIIIII")
_HEADER_CRC = struct.Struct("<I")
assert _HEADER.size + _HEADER_CRC.size == HEADER_NBYTES

RecordKind = Literal["tensor", "bytes"]


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def record_alignment(nbytes: int) -> int:
    return LARGE_RECORD_ALIGNMENT if nbytes >= LARGE_RECORD_BYTES else RECORD_ALIGNMENT


@dataclass
class IndexEntry:
    """Where one value lives in an object and how to rebuild it."""

    key: str
    kind: RecordKind
    dtype: str  # torch dtype name without "torch.", "uint8" for bytes
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32c: int = 0

    def json_without_crc(self) -> str:
        """This entry as a JSON object missing its closing brace and its last field, crc32c."""
        fields = {
            "key": self.key,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False)[:-1]

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "IndexEntry":
        kind = raw["kind"]
        if kind not in ("tensor", "bytes"):
            raise ValueError(f"unknown record kind {kind!r}")
        return cls(
            key=str(raw["key"]),
            kind=kind,
            dtype=str(raw["dtype"]),
            shape=tuple(map(int, raw["shape"])),
            offset=int(raw["offset"]),
            nbytes=int(raw["nbytes"]),
            crc32c=int(raw["crc32c"], 16),
        )


_CRC_FIELD = ',"crc32c":"'
_CRC_HEX_DIGITS = 8


class IndexTemplate:
    """The encoded index with a fixed-width slot for each record's CRC32C.

    Built once per object layout; each save only writes its CRCs into the slots, so
    a state of thousands of tensors is not re-encoded to JSON on every save.
    """

    def __init__(self, entries: Sequence[IndexEntry]) -> None:
        parts = [f'{{"format_version":{FORMAT_VERSION},"records":[']
        length = len(parts[0].encode("utf-8"))
        self.crc_slots: list[int] = []
        for i, entry in enumerate(entries):
            part = ("," if i else "") + entry.json_without_crc() + _CRC_FIELD
            length += len(part.encode("utf-8"))
            self.crc_slots.append(length)
            parts += [part, "0" * _CRC_HEX_DIGITS + '"}']
            length += _CRC_HEX_DIGITS + 2
        parts.append("]}")
        self.template = "".join(parts).encode("utf-8")

    def __len__(self) -> int:
        return len(self.template)

    def fill(self, crcs: Sequence[int]) -> bytes:
        encoded = bytearray(self.template)
        for slot, crc in zip(self.crc_slots, crcs):
            encoded[slot : slot + _CRC_HEX_DIGITS] = b"%08x" % crc
        return bytes(encoded)


def encode_index(entries: Sequence[IndexEntry]) -> bytes:
    return IndexTemplate(entries).fill([e.crc32c for e in entries])


def decode_index(raw: bytes, path: str) -> list[IndexEntry]:
    try:
        payload = json.loads(raw.decode("utf-8"))
        _check_format_version(int(payload["format_version"]), path)
        return [IndexEntry.from_json(r) for r in payload["records"]]
    except FormatVersionError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"index of {path} is malformed ({exc}); the object is unusable") from exc


@dataclass(frozen=True)
class ObjectHeader:
    object_nbytes: int
    index_offset: int
    index_nbytes: int
    index_crc32c: int
    record_count: int
    writer_rank: int
    flags: int = 0

    @property
    def has_data_crc(self) -> bool:
        return not self.flags & FLAG_NO_DATA_CRC

    @property
    def has_zero_padding(self) -> bool:
        return bool(self.flags & FLAG_ZERO_PADDING)

    def encode(self) -> bytes:
        body = _HEADER.pack(
            OBJECT_MAGIC,
            FORMAT_VERSION,
            HEADER_NBYTES,
            self.object_nbytes,
            self.index_offset,
            self.index_nbytes,
            self.index_crc32c,
            self.record_count,
            self.writer_rank,
            self.flags,
            0,
        )
        return body + _HEADER_CRC.pack(_core.crc32c(body))

    @classmethod
    def decode(cls, raw: bytes, path: str) -> "ObjectHeader":
        if len(raw) < HEADER_NBYTES:
            raise CorruptCheckpointError(f"{path} is truncated: {len(raw)} bytes, shorter than its header")
        body, crc_bytes = raw[: _HEADER.size], raw[_HEADER.size : HEADER_NBYTES]
        (magic, version, header_nbytes, object_nbytes, index_offset, index_nbytes, index_crc, count, rank, flags, _) = (
            _HEADER.unpack(body)
        )
        if magic != OBJECT_MAGIC:
            raise CorruptCheckpointError(f"{path} is not a flashpoint object (bad magic {magic!r})")
        (stored_crc,) = _HEADER_CRC.unpack(crc_bytes)
        if _core.crc32c(body) != stored_crc:  # before the version: a flipped version field is damage
            raise CorruptCheckpointError(f"header of {path} fails its checksum; the object is corrupt")
        _check_format_version(version, path)
        if header_nbytes != HEADER_NBYTES or index_offset + index_nbytes > object_nbytes:
            raise CorruptCheckpointError(f"header of {path} describes an impossible layout")
        return cls(object_nbytes, index_offset, index_nbytes, index_crc, count, rank, flags)


def _check_format_version(version: int, path: str) -> None:
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"{path} uses checkpoint format v{version}; this ml_flashpoint_nemo reads v{FORMAT_VERSION} only. "
            "Load it with the release that wrote it, or fall back to the durable checkpoint."
        )


@dataclass(frozen=True)
class ObjectRecord:
    """What a commit record says about one object: enough to find and verify it."""

    name: str  # file name inside the version directory
    rank: int
    nbytes: int
    crc32c: int  # CRC32C of header || index (the index holds every record's data CRC32C)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "nbytes": self.nbytes, "crc32c": f"{self.crc32c:08x}"}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "ObjectRecord":
        return cls(str(raw["name"]), int(raw["rank"]), int(raw["nbytes"]), int(raw["crc32c"], 16))


@dataclass(frozen=True)
class CommitRecord:
    """The record whose presence makes a version exist."""

    step: int
    world_size: int
    objects: tuple[ObjectRecord, ...]
    created_unix: float
    metadata: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        body = json.dumps(
            {
                "magic": COMMIT_MAGIC,
                "format_version": FORMAT_VERSION,
                "step": self.step,
                "world_size": self.world_size,
                "created_unix": self.created_unix,
                "objects": [o.to_json() for o in self.objects],
                "metadata": self.metadata,
            },
            separators=(",", ":"),
            sort_keys=True,
        ).encode("utf-8")
        return body + f"\ncrc32c={_core.crc32c(body):08x}\n".encode("ascii")

    @classmethod
    def decode(cls, raw: bytes, path: str) -> "CommitRecord":
        body, sep, trailer = raw.rpartition(b"\ncrc32c=")
        if not sep or not trailer.endswith(b"\n"):
            raise CorruptCheckpointError(f"commit record {path} is truncated or malformed")
        try:
            stored_crc = int(trailer[:-1].decode("ascii"), 16)
        except ValueError as exc:
            raise CorruptCheckpointError(f"commit record {path} has a malformed checksum") from exc
        if _core.crc32c(body) != stored_crc:
            raise CorruptCheckpointError(f"commit record {path} fails its checksum; the version is corrupt")
        try:
            payload = json.loads(body.decode("utf-8"))
            if payload.get("magic") != COMMIT_MAGIC:
                raise CorruptCheckpointError(f"{path} is not a flashpoint commit record")
            _check_format_version(int(payload["format_version"]), path)
            return cls(
                step=int(payload["step"]),
                world_size=int(payload["world_size"]),
                objects=tuple(ObjectRecord.from_json(o) for o in payload["objects"]),
                created_unix=float(payload["created_unix"]),
                metadata=dict(payload.get("metadata") or {}),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"commit record {path} is malformed ({exc})") from exc

    def objects_of_rank(self, rank: int) -> list[ObjectRecord]:
        return [o for o in self.objects if o.rank == rank]


@dataclass(frozen=True)
class ObjectPlan:
    """Offsets of every record of one object, fixed before any byte is copied."""

    entries: list[IndexEntry]
    index_offset: int
    index: IndexTemplate

    @property
    def object_nbytes(self) -> int:
        return self.index_offset + len(self.index)

    def padding_ranges(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of every gap between header, records and index (each under 4 KiB)."""
        return padding_ranges(self.entries, self.index_offset)


def padding_ranges(entries: Sequence[IndexEntry], index_offset: int) -> list[tuple[int, int]]:
    """The gaps of an object's layout, in file order; ValueError if records overlap or are out of order."""
    gaps = []
    position = HEADER_NBYTES
    for entry in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        if entry.offset < position:
            raise ValueError(f"record {entry.key!r} at offset {entry.offset} overlaps the bytes before it")
        if entry.offset > position:
            gaps.append((position, entry.offset - position))
        position = entry.offset + entry.nbytes
    if index_offset < position:
        raise ValueError(f"the index at offset {index_offset} overlaps the last record")
    if index_offset > position:
        gaps.append((position, index_offset - position))
    return gaps


_ZERO_CRCS: dict[int, int] = {}


def _crc32c_of_zeros(nbytes: int) -> int:
    """CRC32C of nbytes zero bytes (gaps are small and few distinct lengths recur)."""
    crc = _ZERO_CRCS.get(nbytes)
    if crc is None:
        crc = _ZERO_CRCS[nbytes] = _core.crc32c(bytes(nbytes))
    return crc


def object_crc32c_from_index(header_raw: bytes, index_raw: bytes, path: str) -> int | None:
    """CRC32C of the object's bytes [0, object_nbytes), from its header and index alone.

    The data bytes are never read: each record's CRC32C comes from the index and the gaps
    are known to be zero. None when the object cannot vouch for that (saved with checksums
    off, or by a writer that did not zero the padding). Raises CorruptCheckpointError when
    the header or index is damaged or describes an impossible layout.
    """
    header = ObjectHeader.decode(header_raw, path)
    if not header.has_data_crc or not header.has_zero_padding:
        return None
    if len(index_raw) != header.index_nbytes or _core.crc32c(index_raw) != header.index_crc32c:
        raise CorruptCheckpointError(f"index of {path} fails its checksum; the object is corrupt")
    entries = decode_index(index_raw, path)
    try:
        gaps = dict(padding_ranges(entries, header.index_offset))
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path} has an impossible layout: {exc}") from None
    crc = _core.crc32c(header_raw[:HEADER_NBYTES])
    position = HEADER_NBYTES
    for entry in sorted(entries, key=lambda e: (e.offset, e.nbytes)):
        crc, position = _extend_with_zeros(crc, position, gaps)
        crc = _core.crc32c_combine(crc, entry.crc32c, entry.nbytes)
        position += entry.nbytes
    crc, position = _extend_with_zeros(crc, position, gaps)
    return _core.crc32c_combine(crc, header.index_crc32c, header.index_nbytes)


def whole_object_crc32c(fd: int, path: str, record: ObjectRecord | None = None) -> int | None:
    """CRC32C of an object file's bytes [0, object_nbytes), reading only its header and index.

    With a commit record, the header and index must match it (size and checksum), so the CRC
    vouches for exactly the bytes the version names. None when the object does not allow it
    (see object_crc32c_from_index). Raises CorruptCheckpointError for a damaged object.
    """
    header_raw = os.pread(fd, HEADER_NBYTES, 0)
    header = ObjectHeader.decode(header_raw, path)
    if record is not None and header.object_nbytes != record.nbytes:
        raise CorruptCheckpointError(
            f"object {path} says it has {header.object_nbytes} bytes, the commit record {record.nbytes}"
        )
    index_raw = os.pread(fd, header.index_nbytes, header.index_offset)
    if record is not None and _core.crc32c(index_raw, _core.crc32c(header_raw)) != record.crc32c:
        raise CorruptCheckpointError(f"object {path} does not match the checksum in its commit record")
    return object_crc32c_from_index(header_raw, index_raw, path)


def _extend_with_zeros(crc: int, position: int, gaps: dict[int, int]) -> tuple[int, int]:
    """The CRC continued over the gap starting at position, if there is one, and the position after it."""
    nbytes = gaps.get(position, 0)
    if nbytes:
        crc = _core.crc32c_combine(crc, _crc32c_of_zeros(nbytes), nbytes)
    return crc, position + nbytes


def plan_object(values: Iterable[tuple[str, RecordKind, str, tuple[int, ...], int]]) -> ObjectPlan:
    """Place (key, kind, dtype, shape, nbytes) records after the header, each aligned, then the index."""
    entries = []
    offset = HEADER_NBYTES
    for key, kind, dtype, shape, nbytes in values:
        offset = align_up(offset, record_alignment(nbytes))
        entries.append(IndexEntry(key, kind, dtype, shape, offset, nbytes))
        offset += nbytes
    return ObjectPlan(entries, align_up(offset, RECORD_ALIGNMENT), IndexTemplate(entries))
