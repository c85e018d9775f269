"""Objects and commit records that lie with valid checksums are refused before a byte is read.

A buggy writer, or a peer that may push objects, can produce an object whose every CRC is
right but whose index describes records that overrun their tensors, overlap, or lie outside
the data area, or a commit record that names files outside the version. Each case here is
forged with every checksum recomputed (tests/support/forge.py), so only validation can catch
it: the load raises a CorruptCheckpointError that names the object and key, no destination
is written, and the older version still loads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from ml_flashpoint_nemo import CorruptCheckpointError, _core
from ml_flashpoint_nemo.core import CheckpointSaver, load_newest_valid, load_version, verify_version
from ml_flashpoint_nemo.core.format import whole_object_crc32c
from tests.support.forge import forge_commit, forge_object, object_path, records_by_key
from tests.support.multiproc import REPO
from tests.support.states import assert_state_equal


def small_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(16, generator=gen),  # 64 bytes, then "b" right after it
        "b": torch.randn(16, generator=gen),
        "c": torch.randint(0, 100, (4, 8), generator=gen, dtype=torch.int64),
        "big": torch.randn(300_000, generator=gen),  # >= 1 MiB: page-aligned
        "blob": b"some bytes of common state",
    }


@pytest.fixture
def two_versions(base_dir: Path) -> Path:
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, small_state(1), keep=2)
        saver.save(2, small_state(2), keep=2)
    return base_dir


def overrun_a_into_b(raw: bytes) -> Callable[[dict[str, Any]], None]:
    """The issue's case: "a" claims its own bytes and its neighbour's; its CRC covers all of them."""

    def mutate(payload: dict[str, Any]) -> None:
        records = records_by_key(payload)
        a, b = records["a"], records["b"]
        a["nbytes"] = b["offset"] + b["nbytes"] - a["offset"]
        a["crc32c"] = "%08x" % _core.crc32c(raw[a["offset"] : a["offset"] + a["nbytes"]])

    return mutate


def test_a_record_that_overruns_its_tensor_is_refused_without_touching_memory(two_versions):
    # Run in a child: before validation existed this load wrote past the tensor and glibc aborted.
    path = object_path(two_versions, 2)
    forge_object(path, index=overrun_a_into_b(path.read_bytes()))
    script = textwrap.dedent(f"""
        from ml_flashpoint_nemo.core import load_version
        from ml_flashpoint_nemo.errors import CorruptCheckpointError
        for _ in range(50):
            try:
                load_version({str(two_versions)!r}, 2)
            except CorruptCheckpointError as exc:
                message = str(exc)
            else:
                raise SystemExit("the forged version loaded")
        print("REFUSED:", message)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "REFUSED:" in result.stdout and "'a'" in result.stdout and "holds 64" in result.stdout, result.stdout
    step, state = load_newest_valid(two_versions)
    assert step == 1
    assert_state_equal(small_state(1), state)


def _set(key: str, field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(payload: dict[str, Any]) -> None:
        records_by_key(payload)[key][field] = value

    return mutate


def _set_fields(key: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(payload: dict[str, Any]) -> None:
        records_by_key(payload)[key].update(fields)

    return mutate


def _move_next_to(key: str, neighbour: str, delta: int) -> Callable[[dict[str, Any]], None]:
    def mutate(payload: dict[str, Any]) -> None:
        records = records_by_key(payload)
        records[key]["offset"] = records[neighbour]["offset"] + delta

    return mutate


def _duplicate(key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(payload: dict[str, Any]) -> None:
        payload["records"].append(dict(records_by_key(payload)[key]))

    return mutate


INDEX_LIES = {
    "nbytes larger than the tensor": (_set("c", "nbytes", 8 * 32 + 64), "holds 256"),
    "nbytes smaller than the tensor": (_set("c", "nbytes", 8), "holds 256"),
    "shape that does not fit nbytes": (_set("c", "shape", [4, 9]), "holds 288"),
    "a dtype of another size": (_set("a", "dtype", "float64"), "holds 128"),
    "an unknown dtype": (_set("a", "dtype", "float99"), "not known to torch"),
    "a quantized dtype": (_set("a", "dtype", "qint32"), "no writer stores"),
    "a bytes record with a tensor shape": (_set("blob", "shape", [3, 9]), "bytes record"),
    "a bytes record of another dtype": (_set("blob", "dtype", "int8"), "bytes record"),
    "a record inside the header": (_set("a", "offset", 0), "outside the data area"),
    "a record past the index": (_set("big", "offset", 1 << 40), "outside the data area"),
    "a misaligned record": (_set("a", "offset", 64 + 8), "not aligned"),
    "a large record off its page": (_set("big", "offset", 4096 + 64), "not aligned|overlaps|outside"),
    "two records overlapping": (_move_next_to("b", "a", 0), "overlaps"),
    "a key twice": (_duplicate("a"), "twice"),
    "a negative offset": (_set("a", "offset", -64), "malformed"),
    "a float size": (_set("a", "nbytes", 64.0), "malformed"),
    "a bool dimension": (_set("c", "shape", [True, 8]), "malformed"),
    "a crc that is not hex": (_set("a", "crc32c", "zzzzzzzz"), "malformed"),
    "a key that is not a string": (_set("a", "key", 7), "malformed"),
    "an empty record with a data checksum": (_set_fields("a", shape=[0], nbytes=0, crc32c="00000001"),
                                             "has no bytes but data checksum 00000001"),
    "no elements, a dimension past int64": (_set_fields("c", shape=[0, 1 << 63], nbytes=0, crc32c="00000000"),
                                            "which no tensor of int64 can have"),
    "no elements, an extent past int64": (_set_fields("c", shape=[1 << 40, 1 << 40, 0], nbytes=0, crc32c="00000000"),
                                          "which no tensor of int64 can have"),
}


@pytest.mark.parametrize("lie", list(INDEX_LIES), ids=list(INDEX_LIES))
def test_an_index_that_lies_is_refused_and_nothing_is_written(two_versions, lie):
    mutation, message = INDEX_LIES[lie]
    forge_object(object_path(two_versions, 2), index=mutation)
    destinations = {k: torch.full_like(v, 7) for k, v in small_state(2).items() if isinstance(v, torch.Tensor)}
    before = {k: v.clone() for k, v in destinations.items()}
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        load_version(two_versions, 2, into=destinations)
    assert "rank-00000-0.fpo" in str(info.value)
    for key, tensor in destinations.items():
        assert torch.equal(tensor, before[key]), f"{key} was written although the load was refused"
    with pytest.raises(CorruptCheckpointError):
        verify_version(two_versions, 2)
    assert_state_equal(small_state(1), load_newest_valid(two_versions)[1])


@pytest.mark.parametrize("shape", [[0, 1 << 63], [1 << 40, 1 << 40, 0], [0, 1 << 62, 2]],
                         ids=["a dimension past int64", "dimensions whose product passes int64", "strides past int64"])
def test_a_record_of_no_elements_and_an_absurd_shape_is_refused_and_the_older_version_loads(two_versions, shape):
    # Zero elements times anything is zero bytes, so nbytes agrees; torch cannot make the tensor all the same.
    path = object_path(two_versions, 2)
    forge_object(path, index=_set_fields("c", shape=shape, nbytes=0, crc32c="00000000"))
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"record 'c' of {path} has shape {shape}, which no "
                                                                "tensor of int64 can have")):
        load_version(two_versions, 2)
    step, state = load_newest_valid(two_versions)
    assert step == 1
    assert_state_equal(small_state(1), state)


def test_a_version_that_fails_in_a_way_no_check_foresaw_is_skipped(two_versions, caplog):
    # An object that is a symlink to itself: opening it raises a plain OSError (ELOOP), not one of ours.
    path = object_path(two_versions, 2)
    path.unlink()
    path.symlink_to(path.name)
    with pytest.raises(OSError):
        load_version(two_versions, 2)
    with caplog.at_level(logging.WARNING, logger="ml_flashpoint_nemo.core.loader"):
        step, state = load_newest_valid(two_versions)
    assert step == 1
    assert_state_equal(small_state(1), state)
    assert "Skipping RAM checkpoint step 2: version 2 in" in caplog.text and "failed to load (OSError" in caplog.text


def _header(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(fields: dict[str, Any]) -> None:
        fields[field] = value(fields) if callable(value) else value

    return mutate


HEADER_LIES = {
    "a record count that differs from the index": (_header("record_count", lambda f: f["record_count"] + 1),
                                                    "counts 6 records"),
    "an unknown flag": (_header("flags", lambda f: f["flags"] | 0x80), "flags"),
    "a reserved field that is not zero": (_header("reserved", 1), "reserved"),
    "an index inside the header": (_header("index_offset", 32), "index starts at 32"),
    "an object longer than its index": (_header("object_nbytes", lambda f: f["object_nbytes"] + 64),
                                        "does not end the object|truncated"),
    "another writer rank": (_header("writer_rank", 1), "writer rank 1"),
    "an index checksum of other bytes": (_header("index_crc32c", lambda f: f["index_crc32c"] ^ 1), "index checksum"),
}


@pytest.mark.parametrize("lie", list(HEADER_LIES), ids=list(HEADER_LIES))
def test_a_header_that_lies_is_refused(two_versions, lie):
    mutation, message = HEADER_LIES[lie]
    forge_object(object_path(two_versions, 2), header=mutation)
    with pytest.raises(CorruptCheckpointError, match=message):
        load_version(two_versions, 2)
    assert load_newest_valid(two_versions)[0] == 1


@pytest.mark.parametrize("index_bytes", [
    b"[" * 100_000 + b"]" * 100_000,  # nesting deep enough to exhaust the parser's recursion
    b'{"format_version":1,"records":{}}',
    b'{"format_version":true,"records":[]}',
    b'["format_version",1]',
    b"\xff\xfe",
], ids=["deep nesting", "records not a list", "bool version", "not an object", "not UTF-8"])
def test_a_malformed_index_is_refused(two_versions, index_bytes):
    forge_object(object_path(two_versions, 2), index_bytes=index_bytes)
    with pytest.raises(CorruptCheckpointError, match="malformed|impossible|counts"):
        load_version(two_versions, 2)


def _object_entry(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(commit: dict[str, Any]) -> None:
        commit["objects"][0][field] = value

    return mutate


def _version_file(name: str, described: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(commit: dict[str, Any]) -> None:
        commit["metadata"].setdefault("files", {})[name] = described

    return mutate


COMMIT_LIES = {
    "an object outside the version": (_object_entry("name", "../step-1/rank-00000-0.fpo"), "not an object name"),
    "an object of another rank's name": (_object_entry("name", "rank-00001-0.fpo"), "not an object name"),
    "an object of a rank outside the job": (_object_entry("rank", 5), "not an object name"),
    "an object shorter than a header": (_object_entry("nbytes", 10), "shorter than its header"),
    "an object listed twice": (lambda c: c["objects"].append(dict(c["objects"][0])), "listed twice"),
    "a version file at an absolute path": (_version_file("/etc/passwd", {"nbytes": 1, "crc32c": 0}), "plain file"),
    "a version file outside the version": (_version_file("../x", {"nbytes": 1, "crc32c": 0}), "plain file"),
    "a version file named COMMIT": (_version_file("COMMIT", {"nbytes": 1, "crc32c": 0}), "commit record"),
    "a version file named like an object": (_version_file("rank-00000-0.fpo", {"nbytes": 1, "crc32c": 0}),
                                           "an object"),
    "a version file without its size": (_version_file("common.pt", {"crc32c": 0}), "nbytes and crc32c"),
    "a version file checksum out of range": (_version_file("common.pt", {"nbytes": 1, "crc32c": 1 << 40}),
                                             "out-of-range"),
    "no world": (lambda c: c.update(world_size=0), "world_size"),
    "metadata that is not an object": (lambda c: c.update(metadata=[["files", {}]]), "metadata"),
}


@pytest.mark.parametrize("lie", list(COMMIT_LIES), ids=list(COMMIT_LIES))
def test_a_commit_record_that_lies_is_refused(two_versions, lie):
    mutation, message = COMMIT_LIES[lie]
    forge_commit(two_versions / "step-2" / "COMMIT", mutation)
    with pytest.raises(CorruptCheckpointError, match=message):
        load_version(two_versions, 2)
    step, state = load_newest_valid(two_versions)
    assert step == 1
    assert_state_equal(small_state(1), state)


def test_the_replication_crc_refuses_a_lying_index(two_versions):
    # Replication computes the whole object's CRC from its index alone: it must not trust one that overlaps.
    path = object_path(two_versions, 2)
    forge_object(path, index=_move_next_to("b", "a", 0))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptCheckpointError, match="overlaps"):
            whole_object_crc32c(fd, str(path))
    finally:
        os.close(fd)


def test_forged_but_truthful_objects_still_load(two_versions):
    # The forging itself changes nothing a reader cares about: a re-encoded index loads bit-exact.
    forge_object(object_path(two_versions, 2), index=lambda payload: payload.update(records=list(payload["records"])))
    assert_state_equal(small_state(2), load_version(two_versions, 2))
    assert json.loads((two_versions / "step-2" / "COMMIT").read_bytes().rpartition(b"\ncrc32c=")[0])["step"] == 2
