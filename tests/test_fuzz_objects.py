"""Property: a forged object or commit record never crashes a load nor writes outside a destination.

Random mutations of an object's index and header, and of its commit record, are applied with
every checksum recomputed (tests/support/forge.py), so only validation stands between them and
the reader. Whatever the mutation, a load into destinations ends in a FlashpointError or in
bit-exact data, the bytes around each destination stay untouched, and a load without
destinations or a verification either fails with a FlashpointError or returns the saved bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ml_flashpoint_nemo import FlashpointError
from ml_flashpoint_nemo.core import CheckpointSaver, load_version, verify_version
from ml_flashpoint_nemo.core.format import whole_object_crc32c
from tests.support.forge import FIELDS, forge_commit, forge_object, object_path
from tests.support.states import raw_bytes

GUARD = 256  # canary bytes on each side of a destination
CANARY = 0xA5


def fuzz_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {
        "f32": torch.randn(16, generator=gen),
        "i64": torch.randint(-9, 9, (3, 5), generator=gen, dtype=torch.int64),
        "bf16": torch.randn(33, generator=gen).to(torch.bfloat16),
        "flag": torch.tensor([True, False, True]),
        "zeros": torch.zeros(16),  # a record whose bytes match the zero padding
        "big": torch.randn(270_000, generator=gen),  # >= 1 MiB: page-aligned
        "blob": b"common state bytes",
    }


STATE = fuzz_state()

INTERESTING_INTS = st.one_of(
    st.sampled_from([0, 1, 7, 8, 63, 64, 65, 4095, 4096, 4160, 1 << 20, (1 << 31) - 1, 1 << 32, (1 << 63) - 1,
                     1 << 64, -1, -64]),
    st.integers(min_value=0, max_value=1 << 21),
)
ODD_VALUES = st.sampled_from([None, True, 1.5, "64", [], {}, [64], "float32", ""])
RECORD_FIELDS = ["key", "kind", "dtype", "shape", "offset", "nbytes", "crc32c"]


@st.composite
def index_mutation(draw: st.DrawFn) -> list[tuple[str, Any, Any]]:
    """A few (record number, field, value) changes; a value may be relative (an int delta on the old one)."""
    changes = []
    for _ in range(draw(st.integers(1, 3))):
        record = draw(st.integers(0, len(STATE) - 1))
        field = draw(st.sampled_from(RECORD_FIELDS))
        if field in ("offset", "nbytes"):
            value = draw(st.one_of(INTERESTING_INTS, st.tuples(st.just("delta"), st.sampled_from(
                [-4096, -128, -64, -8, -1, 1, 8, 64, 128, 4096])), ODD_VALUES))
        elif field == "shape":
            value = draw(st.one_of(st.lists(INTERESTING_INTS, max_size=3), ODD_VALUES))
        elif field == "dtype":
            value = draw(st.one_of(st.sampled_from(["float32", "int32", "float64", "uint8", "bool", "bfloat16",
                                                    "complex128", "float8_e4m3fn", "qint8", "Tensor", "nope"]),
                                   ODD_VALUES))
        elif field == "kind":
            value = draw(st.one_of(st.sampled_from(["tensor", "bytes", "other"]), ODD_VALUES))
        elif field == "key":
            value = draw(st.one_of(st.sampled_from(list(STATE)), st.text(max_size=4), ODD_VALUES))
        else:
            value = draw(st.one_of(st.sampled_from(["00000000", "ffffffff", "FFFFFFFF", "1234567"]), ODD_VALUES))
        changes.append((record, field, value))
    return changes


def apply_index_changes(payload: dict[str, Any], changes: list[tuple[str, Any, Any]]) -> None:
    for number, field, value in changes:
        record = payload["records"][number % len(payload["records"])]
        if isinstance(value, tuple):
            old = record[field]
            value = old + value[1] if isinstance(old, int) else old
        record[field] = value


header_mutation = st.lists(st.tuples(st.sampled_from([f for f in FIELDS if f not in ("magic", "format_version")]),
                                     INTERESTING_INTS), min_size=1, max_size=2)
commit_mutation = st.lists(st.tuples(st.sampled_from(["name", "rank", "nbytes", "crc32c", "world_size", "step"]),
                                     st.one_of(INTERESTING_INTS, ODD_VALUES,
                                               st.sampled_from(["rank-00000-0.fpo", "rank-00001-0.fpo",
                                                                "../rank-00000-0.fpo", "/etc/passwd"]))),
                           min_size=1, max_size=2)


class Pristine:
    """One saved version and its files' bytes, put back before every example (short repr for reports)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        with CheckpointSaver(base) as saver:
            saver.save(1, STATE)
        self.files = {p.name: p.read_bytes() for p in (base / "step-1").iterdir()}

    def restore(self) -> Path:
        version = self.base / "step-1"
        for path in version.iterdir():
            if path.name not in self.files:
                path.unlink()
        for name, data in self.files.items():
            (version / name).write_bytes(data)
        return self.base

    def __repr__(self) -> str:
        return f"Pristine({self.base})"


@pytest.fixture(scope="module")
def pristine() -> Iterator[Pristine]:
    base = Path("/dev/shm") / f"flashpoint-fuzz-{os.getpid()}"
    yield Pristine(base)
    shutil.rmtree(base, ignore_errors=True)


def guarded_destinations() -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, int]]]:
    """A destination per tensor inside an arena of canary bytes, and (arena, nbytes) to check them."""
    destinations, arenas = {}, []
    for key, value in STATE.items():
        if not isinstance(value, torch.Tensor):
            continue
        nbytes = value.numel() * value.element_size()
        arena = torch.full((nbytes + 2 * GUARD,), CANARY, dtype=torch.uint8)
        destinations[key] = arena[GUARD : GUARD + nbytes].view(value.dtype).view(value.shape)
        arenas.append((arena, nbytes))
    return destinations, arenas


def check_loads(base: Path) -> None:
    """The property, for whatever now lies in base/step-1."""
    destinations, arenas = guarded_destinations()
    try:
        loaded = load_version(base, 1, into=destinations, keys=list(STATE))
    except FlashpointError:
        pass
    else:
        for key, value in STATE.items():
            got = loaded[key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and got.shape == value.shape, key
                assert torch.equal(raw_bytes(got), raw_bytes(value)), f"{key} loaded different bytes"
            else:
                assert bytes(got) == value, key
    for arena, nbytes in arenas:
        assert bool((arena[:GUARD] == CANARY).all()) and bool((arena[GUARD + nbytes :] == CANARY).all()), \
            "a load wrote outside its destination"
    try:
        fresh = load_version(base, 1)
    except FlashpointError:
        pass
    else:
        saved = sorted(bytes(raw_bytes(v).numpy()) if isinstance(v, torch.Tensor) else bytes(v) for v in STATE.values())
        got = sorted(bytes(raw_bytes(v).numpy()) if isinstance(v, torch.Tensor) else bytes(v) for v in fresh.values())
        assert got == saved, "a load without destinations returned bytes that were never saved"
    try:
        verify_version(base, 1)
    except FlashpointError:
        pass
    fd = os.open(object_path(base, 1), os.O_RDONLY)
    try:
        whole_object_crc32c(fd, "fuzzed object")
    except FlashpointError:
        pass
    finally:
        os.close(fd)


FUZZ = settings(max_examples=int(os.environ.get("FLASHPOINT_FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True)


@FUZZ
@given(changes=index_mutation())
def test_fuzzed_index_never_crashes_nor_overruns(pristine, changes):
    base = pristine.restore()
    forge_object(object_path(base, 1), index=lambda payload: apply_index_changes(payload, changes))
    check_loads(base)


@FUZZ
@given(changes=header_mutation, index_too=st.booleans())
def test_fuzzed_header_never_crashes_nor_overruns(pristine, changes, index_too):
    base = pristine.restore()

    def mutate(fields: dict[str, Any]) -> None:
        for field, value in changes:
            fields[field] = value % (1 << (64 if field in ("object_nbytes", "index_offset", "index_nbytes") else 32))

    forge_object(object_path(base, 1), header=mutate,
                 index=(lambda payload: payload["records"].reverse()) if index_too else None)
    check_loads(base)


@FUZZ
@given(changes=commit_mutation)
def test_fuzzed_commit_record_never_crashes_nor_overruns(pristine, changes):
    base = pristine.restore()

    def mutate(commit: dict[str, Any]) -> None:
        for field, value in changes:
            if field in ("world_size", "step"):
                commit[field] = value
            else:
                commit["objects"][0][field] = value

    forge_commit(base / "step-1" / "COMMIT", mutate)
    check_loads(base)


@FUZZ
@given(position=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_fuzzed_index_bytes_never_crash(pristine, position, byte):
    """One byte of the index text replaced (CRCs recomputed): malformed JSON, other numbers, other names."""
    base = pristine.restore()
    path = object_path(base, 1)
    raw = path.read_bytes()
    index_offset, index_nbytes = int.from_bytes(raw[24:32], "little"), int.from_bytes(raw[32:40], "little")
    text = bytearray(raw[index_offset : index_offset + index_nbytes])
    text[position % len(text)] = byte
    forge_object(path, index_bytes=bytes(text))
    check_loads(base)


def test_the_fuzz_harness_sees_an_unmodified_object_load(pristine):
    base = pristine.restore()
    loaded = load_version(base, 1)
    assert json.dumps(sorted(loaded)) == json.dumps(sorted(STATE))
    forge_object(object_path(base, 1), index=lambda payload: None)  # re-encoded, nothing changed
    destinations, _ = guarded_destinations()
    load_version(base, 1, into=destinations)
    for key, value in STATE.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(raw_bytes(destinations[key]), raw_bytes(value))
