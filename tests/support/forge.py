"""Forged checkpoints: objects and commit records rewritten with every checksum recomputed.

A CRC proves only that bytes are the ones written. These helpers play a buggy writer or a
hostile peer: they change what an object's header, index or commit record says and then make
every CRC32C (index, header, commit record) consistent again, so that only validation, not a
checksum, can catch the lie.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable

from ml_flashpoint_nemo import _core

HEADER = struct.Struct("<8sIIQQQIIIII")  # the header's fields before its CRC (docs/format.md)
FIELDS = ("magic", "format_version", "header_nbytes", "object_nbytes", "index_offset", "index_nbytes",
          "index_crc32c", "record_count", "writer_rank", "flags", "reserved")

Mutation = Callable[[dict[str, Any]], None]


def object_path(base_dir: Path, step: int, rank: int = 0) -> Path:
    return base_dir / f"step-{step}" / f"rank-{rank:05d}-0.fpo"


def read_parts(path: Path) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """(header fields, index JSON, the whole file's bytes) of an object file."""
    raw = path.read_bytes()
    header = dict(zip(FIELDS, HEADER.unpack_from(raw, 0)))
    index = json.loads(raw[header["index_offset"] : header["index_offset"] + header["index_nbytes"]])
    return header, index, raw


def encode_header(header: dict[str, Any]) -> bytes:
    body = HEADER.pack(*(header[f] for f in FIELDS))
    return body + struct.pack("<I", _core.crc32c(body))


def forge_object(path: Path, *, index: Mutation | None = None, header: Mutation | None = None,
                 index_bytes: bytes | None = None, keep_index_crc: bool = False) -> None:
    """Rewrite an object's index and header as the mutations say, CRCs recomputed, then fix its COMMIT."""
    fields, payload, raw = read_parts(path)
    if index is not None:
        index(payload)
    encoded = index_bytes if index_bytes is not None else json.dumps(payload, separators=(",", ":")).encode()
    fields["index_nbytes"] = len(encoded)
    fields["object_nbytes"] = fields["index_offset"] + len(encoded)
    if not keep_index_crc:
        fields["index_crc32c"] = _core.crc32c(encoded)
    if index is not None and isinstance(payload.get("records"), list):
        fields["record_count"] = len(payload["records"])
    data_end = fields["index_offset"]  # the records stay where they are, whatever the header then says
    if header is not None:
        header(fields)
    head = encode_header(fields)
    path.write_bytes(head + raw[64:data_end] + encoded)
    object_crc = _core.crc32c(encoded, _core.crc32c(head))
    object_nbytes = fields["object_nbytes"]

    def point_at_object(commit: dict[str, Any]) -> None:
        for entry in commit["objects"]:
            if entry["name"] == path.name:
                entry["nbytes"] = object_nbytes
                entry["crc32c"] = f"{object_crc:08x}"

    forge_commit(path.parent / "COMMIT", point_at_object)


def forge_header(path: Path, mutation: Mutation) -> None:
    """Rewrite an object's header in place as the mutation says, its CRC recomputed; nothing else changes
    (not the index, not the object's entry in COMMIT): a reader that trusts the header stops there."""
    fields, _, _ = read_parts(path)
    mutation(fields)
    with open(path, "r+b") as handle:
        handle.write(encode_header(fields))


def forge_commit(path: Path, mutation: Mutation) -> None:
    """Rewrite a commit record's JSON as the mutation says, its trailer CRC recomputed."""
    body = path.read_bytes().rpartition(b"\ncrc32c=")[0]
    payload = json.loads(body)
    mutation(payload)
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    path.write_bytes(body + f"\ncrc32c={_core.crc32c(body):08x}\n".encode())


def records_by_key(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in payload["records"]}
