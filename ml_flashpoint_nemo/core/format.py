"""Format v1: the bytes of object headers, object indexes and commit records.

docs/format.md is the specification; this module is its only implementation.
Nothing here pickles: headers are fixed binary structs, indexes and commit
records are UTF-8 JSON protected by CRC32C.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from itertools import accumulate
from operator import attrgetter
from typing import Any, Callable, Iterable, Literal, Sequence

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.layout import rank_of_object, version_file_name_problem
from ml_flashpoint_nemo.errors import ChecksumError, CorruptCheckpointError, FormatVersionError, UnsupportedValueError

FORMAT_VERSION = 1
OBJECT_MAGIC = b"MLFPOBJ\x00"
COMMIT_MAGIC = "ml_flashpoint_nemo/commit"
HEADER_NBYTES = 64
RECORD_ALIGNMENT = 64
LARGE_RECORD_ALIGNMENT = 4096  # records of at least LARGE_RECORD_BYTES start on a page
LARGE_RECORD_BYTES = 1 << 20
FLAG_NO_DATA_CRC = 1  # written with checksums off: record CRC32C fields are 0 and not checked
FLAG_ZERO_PADDING = 2  # every byte outside the header, the records and the index is zero
KNOWN_FLAGS = FLAG_NO_DATA_CRC | FLAG_ZERO_PADDING
FILES_KEY = "files"  # commit metadata key: {version-level file name: {"nbytes": N, "crc32c": C}}
_U32_LIMIT = 1 << 32
# The most elements times bytes per element a tensor record may describe, its zero dimensions counted as one:
# torch computes strides and sizes in int64, so a shape past it (even of no elements) cannot be allocated.
MAX_TENSOR_EXTENT = 1 << 62
_CRC_HEX = re.compile(r"^[0-9a-f]{8}$")
_json_string = json.encoder.encode_basestring  # a str as json.dumps(..., ensure_ascii=False) writes it

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
        """This entry as a JSON object missing its closing brace and its last field, crc32c.

        The text json.dumps(fields, separators=(",", ":"), ensure_ascii=False) gives, built
        directly: dumps was most of the time it takes to plan an object of thousands of records.
        """
        return (
            f'{{"key":{_json_string(self.key)},"kind":{_json_string(self.kind)},"dtype":{_json_string(self.dtype)},'
            f'"shape":[{",".join(map(int.__repr__, self.shape))}],"offset":{int.__repr__(self.offset)},'
            f'"nbytes":{int.__repr__(self.nbytes)}'
        )

    @classmethod
    def from_json(cls, raw: Any) -> "IndexEntry":
        """One index record, every field of the exact JSON type the writer writes (ValueError otherwise)."""
        if not isinstance(raw, dict):
            raise ValueError(f"a record is a JSON {type(raw).__name__}, not an object")
        kind = raw["kind"]
        if kind not in ("tensor", "bytes"):
            raise ValueError(f"unknown record kind {kind!r}")
        shape = raw["shape"]
        if not isinstance(shape, list):
            raise ValueError(f"shape {shape!r} is not a list")
        crc = raw["crc32c"]
        if not isinstance(crc, str) or not _CRC_HEX.match(crc):
            raise ValueError(f"crc32c {crc!r} is not 8 lowercase hex digits")
        return cls(
            key=_json_str(raw["key"], "key"),
            kind=kind,
            dtype=_json_str(raw["dtype"], "dtype"),
            shape=tuple(_json_count(d, "a dimension") for d in shape),
            offset=_json_count(raw["offset"], "offset"),
            nbytes=_json_count(raw["nbytes"], "nbytes"),
            crc32c=int(crc, 16),
        )


def _json_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} {value!r} is not a string")
    return value


def _json_object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    return value


def _json_time(value: Any, what: str) -> float:
    """A JSON number that is a finite time in seconds (not a bool, a string, NaN or infinity)."""
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{what} {value!r} is not a finite number")
    return float(value)


def _json_count(value: Any, what: str) -> int:
    """A JSON integer >= 0 (not a bool, not a float)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} {value!r} is not an integer >= 0")
    return value


_CRC_FIELD = ',"crc32c":"'
_CRC_HEX_DIGITS = 8
_CRC_SLOT = _CRC_FIELD + "0" * _CRC_HEX_DIGITS + '"}'  # a record's end in the template, its CRC still zero


class IndexTemplate:
    """The encoded index with a fixed-width slot for each record's CRC32C.

    Built once per object layout; each save only writes its CRCs into the slots, so
    a state of thousands of tensors is not re-encoded to JSON on every save.
    """

    def __init__(self, entries: Sequence[IndexEntry]) -> None:
        head = f'{{"format_version":{FORMAT_VERSION},"records":['
        bodies = [entry.json_without_crc() for entry in entries]
        text = head + (_CRC_SLOT + ",").join(bodies) + (_CRC_SLOT if bodies else "") + "]}"
        self.template = text.encode("utf-8")
        # Byte lengths of the bodies: their character counts when the whole text is ASCII (the usual keys).
        lengths = map(len, bodies) if len(self.template) == len(text) else (len(b.encode("utf-8")) for b in bodies)
        # Record i's slot lies len(_CRC_FIELD) bytes past the end of its body; each record adds its body, its
        # CRC slot and a comma.
        step = len(_CRC_SLOT) + 1
        slots = accumulate(map(step.__add__, lengths), initial=len(head) - step + len(_CRC_FIELD))
        next(slots)  # the initial value: no record
        self.crc_slots: list[int] = list(slots)

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
    """The records of an index, each well-typed; validate_index checks them against the header."""
    try:
        payload = json.loads(raw.decode("utf-8"))
        if not isinstance(payload, dict) or not isinstance(payload.get("records"), list):
            raise ValueError("the index is not an object with a list of records")
        _check_format_version(_json_count(payload["format_version"], "format_version"), path)
        return [IndexEntry.from_json(r) for r in payload["records"]]
    except FormatVersionError:
        raise
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CorruptCheckpointError(f"index of {path} is malformed ({exc}); the object is unusable") from exc


def validate_index(header: "ObjectHeader", entries: Sequence[IndexEntry], path: str) -> dict[str, IndexEntry]:
    """Refuse an index that is not exactly what a v1 writer produces, before any data is read; return it by key.

    A CRC only proves that the bytes are the ones written, not that the writer (or a peer that
    pushed the object) described them truthfully. Each record must hold exactly its tensor's bytes,
    lie aligned inside the data area and overlap nothing, so that no read can run past its
    destination or into another record. docs/format.md ("Validation") lists the rules.
    """
    if header.record_count != len(entries):
        raise CorruptCheckpointError(
            f"{path}: the header counts {header.record_count} records, the index holds {len(entries)}. "
            + CORRUPT_ADVICE
        )
    # Deferred: the dtype rules need torch, which the commit records, `flashpoint ls` and `clean` do not (1-2 s).
    from ml_flashpoint_nemo.core.values import QUANTIZED_DTYPES, dtype_from_name

    by_key: dict[str, IndexEntry] = {}
    for entry in entries:
        if entry.key in by_key:
            raise CorruptCheckpointError(f"{path} holds key {entry.key!r} twice. " + CORRUPT_ADVICE)
        by_key[entry.key] = entry
        problem = _record_problem(entry, header, dtype_from_name, QUANTIZED_DTYPES)
        if problem:
            raise CorruptCheckpointError(f"record {entry.key!r} of {path} {problem}. " + CORRUPT_ADVICE)
    try:
        padding_ranges(entries, header.index_offset)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path} has an impossible layout: {exc}. " + CORRUPT_ADVICE) from None
    return by_key


CORRUPT_ADVICE = "Load an older version or the durable checkpoint."


def _record_problem(entry: IndexEntry, header: "ObjectHeader", dtype_from_name: Callable[[str], Any],
                    quantized_dtypes: frozenset[Any]) -> str | None:
    """Why one record breaks the format (its size, placement or checksum field), or None."""
    if entry.kind == "bytes":
        if entry.dtype != "uint8" or entry.shape != (entry.nbytes,):
            return f"is a bytes record of dtype {entry.dtype} and shape {list(entry.shape)}, not uint8[{entry.nbytes}]"
    else:
        try:
            dtype = dtype_from_name(entry.dtype)
        except UnsupportedValueError as exc:
            return f"cannot be read: {exc}"
        if dtype in quantized_dtypes:
            return f"has dtype {entry.dtype}, which no writer stores (its scale lives outside its bytes)"
        itemsize = dtype.itemsize
        expected = math.prod(entry.shape) * itemsize
        if expected > MAX_TENSOR_EXTENT or (not expected and extent_of_shape(entry.shape, itemsize) > MAX_TENSOR_EXTENT):
            return f"has shape {list(entry.shape)}, which no tensor of {entry.dtype} can have"
        if entry.nbytes != expected:
            return (f"says {entry.nbytes} bytes, but {entry.dtype}{list(entry.shape)} holds {expected}")
    if entry.offset < HEADER_NBYTES or entry.offset + entry.nbytes > header.index_offset:
        return f"lies outside the data area [{HEADER_NBYTES}, {header.index_offset})"
    if entry.offset % record_alignment(entry.nbytes):
        return f"starts at {entry.offset}, not aligned to {record_alignment(entry.nbytes)} bytes"
    if not header.has_data_crc and entry.crc32c:
        return "carries a data checksum in an object saved without checksums"
    if entry.nbytes == 0 and entry.crc32c:
        return f"has no bytes but data checksum {entry.crc32c:08x} (the CRC32C of no bytes is 00000000)"
    return None


def extent_of_shape(shape: Sequence[int], itemsize: int) -> int:
    """The bytes a shape spans with its zero dimensions counted as one: what torch's int64 strides must hold."""
    return math.prod(d or 1 for d in shape) * itemsize


@dataclass(frozen=True)
class ObjectHeader:
    object_nbytes: int
    index_offset: int
    index_nbytes: int
    index_crc32c: int
    record_count: int
    writer_rank: int
    flags: int = 0
    reserved: int = 0

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
            self.reserved,
        )
        return body + _HEADER_CRC.pack(_core.crc32c(body))

    @classmethod
    def decode(cls, raw: bytes, path: str) -> "ObjectHeader":
        if len(raw) < HEADER_NBYTES:
            raise CorruptCheckpointError(f"{path} is truncated: {len(raw)} bytes, shorter than its header")
        body, crc_bytes = raw[: _HEADER.size], raw[_HEADER.size : HEADER_NBYTES]
        (magic, version, header_nbytes, object_nbytes, index_offset, index_nbytes, index_crc, count, rank, flags,
         reserved) = _HEADER.unpack(body)
        if magic != OBJECT_MAGIC:
            raise CorruptCheckpointError(f"{path} is not a flashpoint object (bad magic {magic!r})")
        (stored_crc,) = _HEADER_CRC.unpack(crc_bytes)
        if _core.crc32c(body) != stored_crc:  # before the version: a flipped version field is damage
            raise CorruptCheckpointError(f"header of {path} fails its checksum; the object is corrupt")
        _check_format_version(version, path)
        problem = _header_problem(header_nbytes, object_nbytes, index_offset, index_nbytes, flags, reserved)
        if problem:
            raise CorruptCheckpointError(f"header of {path} describes an impossible object: {problem}. " + CORRUPT_ADVICE)
        return cls(object_nbytes, index_offset, index_nbytes, index_crc, count, rank, flags, reserved)


def _header_problem(header_nbytes: int, object_nbytes: int, index_offset: int, index_nbytes: int, flags: int,
                    reserved: int) -> str | None:
    if header_nbytes != HEADER_NBYTES:
        return f"header_nbytes is {header_nbytes}, not {HEADER_NBYTES}"
    if index_offset < HEADER_NBYTES or index_offset % RECORD_ALIGNMENT:
        return f"the index starts at {index_offset}, not at a multiple of {RECORD_ALIGNMENT} after the header"
    if index_offset + index_nbytes != object_nbytes:
        return f"the index [{index_offset}, +{index_nbytes}) does not end the object at {object_nbytes}"
    if flags & ~KNOWN_FLAGS:
        return f"flags {flags:#x} has bits this release does not know"
    if reserved:
        return f"the reserved field is {reserved}, not 0"
    return None


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
    def from_json(cls, raw: Any) -> "ObjectRecord":
        if not isinstance(raw, dict):
            raise ValueError(f"an object entry is a JSON {type(raw).__name__}, not an object")
        crc = raw["crc32c"]
        if not isinstance(crc, str) or not _CRC_HEX.match(crc):
            raise ValueError(f"object crc32c {crc!r} is not 8 lowercase hex digits")
        return cls(_json_str(raw["name"], "name"), _json_count(raw["rank"], "rank"),
                   _json_count(raw["nbytes"], "nbytes"), int(crc, 16))


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
            record = cls(
                step=_json_count(payload["step"], "step"),
                world_size=_json_count(payload["world_size"], "world_size"),
                objects=tuple(ObjectRecord.from_json(o) for o in payload["objects"]),
                created_unix=_json_time(payload["created_unix"], "created_unix"),
                metadata=_json_object(payload.get("metadata") or {}, "metadata"),
            )
            _check_commit_contents(record)
            return record
        except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as exc:
            raise CorruptCheckpointError(f"commit record {path} is malformed ({exc}). {CORRUPT_ADVICE}") from exc

    def objects_of_rank(self, rank: int) -> list[ObjectRecord]:
        return [o for o in self.objects if o.rank == rank]


def _check_commit_contents(record: CommitRecord) -> None:
    """ValueError unless every object and version file the record names is one a v1 writer names.

    Names become paths under the version directory, so each must be a layout name (an object
    of the rank it claims, a plain version-file name) and appear once; sizes and checksums must
    be in range.
    """
    if record.world_size < 1:
        raise ValueError(f"world_size is {record.world_size}")
    names: set[str] = set()
    for obj in record.objects:
        if rank_of_object(obj.name) != obj.rank or obj.rank >= record.world_size:
            raise ValueError(f"object {obj.name!r} of rank {obj.rank} is not an object name of a rank of the job")
        if obj.name in names:
            raise ValueError(f"object {obj.name!r} is listed twice")
        if obj.nbytes < HEADER_NBYTES:
            raise ValueError(f"object {obj.name!r} is {obj.nbytes} bytes, shorter than its header")
        names.add(obj.name)
    files = record.metadata.get(FILES_KEY)
    if files is None:
        return
    if not isinstance(files, dict):
        raise ValueError("metadata.files is not an object")
    for name, described in files.items():
        problem = version_file_name_problem(name)
        if problem:
            raise ValueError(f"version file {name!r} is refused: {problem}")
        if not isinstance(described, dict) or set(described) != {"nbytes", "crc32c"}:
            raise ValueError(f"version file {name!r} is not described by its nbytes and crc32c")
        _json_count(described["nbytes"], "nbytes")
        if _json_count(described["crc32c"], "crc32c") >= _U32_LIMIT:
            raise ValueError(f"version file {name!r} has an out-of-range checksum")


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


_FILE_ORDER = attrgetter("offset", "nbytes")  # records as they lie in the file


def padding_ranges(entries: Sequence[IndexEntry], index_offset: int) -> list[tuple[int, int]]:
    """The gaps of an object's layout, in file order; ValueError if records overlap or are out of order."""
    gaps = []
    position = HEADER_NBYTES
    for entry in sorted(entries, key=_FILE_ORDER):
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
    validate_index(header, entries, path)
    gaps = dict(padding_ranges(entries, header.index_offset))
    crc = _core.crc32c(header_raw[:HEADER_NBYTES])
    position = HEADER_NBYTES
    for entry in sorted(entries, key=_FILE_ORDER):
        crc, position = _extend_with_zeros(crc, position, gaps)
        crc = _core.crc32c_combine(crc, entry.crc32c, entry.nbytes)
        position += entry.nbytes
    crc, position = _extend_with_zeros(crc, position, gaps)
    return _core.crc32c_combine(crc, header.index_crc32c, header.index_nbytes)


def read_index_named_by(fd: int, header_raw: bytes, header: "ObjectHeader", record: ObjectRecord, path: str) -> bytes:
    """The object's index, once its header and index are shown to be the ones its commit record names.

    The record's CRC covers header || index, but a header ends with its own CRC, so every
    self-consistent header adds the same CRC: the record binds the index, and of the header only
    what is checked here field by field (size, writer rank, the index's CRC). The size is checked
    before the index is read, so the read stays inside the record's bytes (which the caller has
    found in the file). Every reader that trusts an object on its record's word goes through this
    (core/loader.py's open_object, whole_object_crc32c).
    """
    if header.object_nbytes != record.nbytes:
        raise CorruptCheckpointError(
            f"object {path} says it has {header.object_nbytes} bytes, the commit record {record.nbytes}. "
            + CORRUPT_ADVICE
        )
    index_raw = os.pread(fd, header.index_nbytes, header.index_offset)
    index_crc = _core.crc32c(index_raw)
    if _core.crc32c_combine(_core.crc32c(header_raw), index_crc, len(index_raw)) != record.crc32c:
        raise ChecksumError(f"object {path} does not match the checksum in its commit record. {CORRUPT_ADVICE}",
                            path=path)
    if index_crc != header.index_crc32c or header.writer_rank != record.rank:
        raise CorruptCheckpointError(
            f"object {path}: its header names index checksum {header.index_crc32c:08x} and writer rank "
            f"{header.writer_rank}, but its index has {index_crc:08x} and the commit record says rank "
            f"{record.rank}. {CORRUPT_ADVICE}"
        )
    return index_raw


def whole_object_crc32c(fd: int, path: str, record: ObjectRecord | None = None) -> int | None:
    """CRC32C of an object file's bytes [0, object_nbytes), reading only its header and index.

    With a commit record, the header and index must be the ones it names (read_index_named_by),
    so the CRC vouches for exactly the bytes the version names. None when the object does not
    allow it (see object_crc32c_from_index). Raises CorruptCheckpointError for a damaged object.
    """
    header_raw = os.pread(fd, HEADER_NBYTES, 0)
    header = ObjectHeader.decode(header_raw, path)
    file_size = os.fstat(fd).st_size
    if header.object_nbytes > file_size:
        raise CorruptCheckpointError(f"object {path} says it has {header.object_nbytes} bytes, the file {file_size}")
    if record is None:
        index_raw = os.pread(fd, header.index_nbytes, header.index_offset)
    else:
        index_raw = read_index_named_by(fd, header_raw, header, record, path)
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
