"""Save/load round trips of the core: every dtype, odd tensors, many tensors, random states."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core import (
    CheckpointSaver,
    committed_steps,
    delete_superseded,
    list_versions,
    load_version,
    loader,
    read_commit,
    verify_version,
)
from ml_flashpoint_nemo.core.format import (
    FORMAT_VERSION,
    HEADER_NBYTES,
    IndexEntry,
    IndexTemplate,
    ObjectHeader,
    object_crc32c_from_index,
    whole_object_crc32c,
)
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.values import QUANTIZED_DTYPES, tensor_columns
from ml_flashpoint_nemo.errors import CorruptCheckpointError
from tests.support.states import assert_state_equal, make_state, raw_bytes

REQUIRED_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex32, torch.complex64, torch.complex128, torch.bool, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
}


def random_tensor_of(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as dtype: covers NaN payloads and every bit pattern."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw & 1  # a bool byte other than 0/1 is not a valid bool
    return raw.view(dtype).reshape(shape)


def storable_dtypes() -> list[torch.dtype]:
    """Every dtype of this torch whose tensors can be created from bytes, less the quantized ones (refused)."""
    found = []
    for name in dir(torch):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or dtype in found or dtype in QUANTIZED_DTYPES:
            continue
        try:
            random_tensor_of(dtype, (3, 5))
        except (RuntimeError, TypeError):
            continue
        found.append(dtype)
    return found


def test_every_dtype_round_trips_bit_exact(base_dir):
    dtypes = storable_dtypes()
    assert REQUIRED_DTYPES <= set(dtypes), f"cannot build {REQUIRED_DTYPES - set(dtypes)}"
    state = {str(d): random_tensor_of(d, (3, 5), seed=i) for i, d in enumerate(dtypes)}
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
    assert_state_equal(state, load_version(base_dir, 1))


def test_odd_tensors_round_trip(base_dir):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    complex_values = torch.randn(8, dtype=torch.complex64)
    state = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "scalar": torch.tensor(7, dtype=torch.int16),
        "scalar_bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "empty_3d": torch.empty(2, 0, 3, dtype=torch.float16),
        "conj_view": complex_values.conj(),
        "neg_view": torch._neg_view(torch.randn(5)),
        "parameter": torch.nn.Parameter(torch.randn(4, 4)),
        "offset_view": base.reshape(-1)[7:19],
        "bytes": b"\x00\x01binary\xff",
        "bytearray": bytearray(b"abc"),
        "memoryview": memoryview(b"view-bytes"),
        "empty_bytes": b"",
        "unicode key \u00e9\u4e2d": torch.ones(2),
    }
    with CheckpointSaver(base_dir) as saver:
        saver.save(3, state)
    loaded = load_version(base_dir, 3)
    assert_state_equal(state, loaded)
    assert torch.equal(loaded["conj_view"], complex_values.conj().resolve_conj())
    assert isinstance(loaded["bytes"], bytes)


def test_thousands_of_tiny_tensors(base_dir):
    state = {f"layer.{i}.bias": torch.full((i % 7 + 1,), float(i)) for i in range(3000)}
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
    assert_state_equal(state, load_version(base_dir, 1))
    assert verify_version(base_dir, 1).records == 3000


def test_large_tensor_split_over_threads(base_dir):
    state = {"big": torch.randn(6 << 20), "small": torch.randn(3)}  # 24 MiB: several pieces per thread
    with CheckpointSaver(base_dir, threads=2) as saver:
        saver.save(1, state)
    assert_state_equal(state, load_version(base_dir, 1, threads=2))


def test_strided_destinations_are_filled_batch_by_batch(base_dir, monkeypatch):
    # The staged path (GPU or non-contiguous destinations) reads and hands over in batches: here 64 KiB.
    monkeypatch.setattr(loader, "UPLOAD_BATCH_NBYTES", 64 << 10)
    state = make_state(3, small_tensors=20)
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
    into = {key: torch.zeros(value.numel() * 2, dtype=value.dtype)[::2].view(value.shape)
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.dtype != torch.bool}  # torch's strided copy canonicalises bools
    assert len(into) > 3 and not any(t.is_contiguous() for t in into.values() if t.numel() > 1)
    loaded = load_version(base_dir, 1, into=into)
    assert all(loaded[key] is tensor for key, tensor in into.items())
    assert_state_equal(state, loaded)


def test_load_into_given_tensors_in_place(base_dir):
    state = make_state(1, small_tensors=20)
    with CheckpointSaver(base_dir) as saver:
        saver.save(5, state)
    contiguous = torch.zeros_like(state["large.0"])
    strided_storage = torch.zeros(state["large.1"].numel() * 2)
    strided = strided_storage[::2]
    loaded = load_version(base_dir, 5, into={"large.0": contiguous, "large.1": strided})
    assert loaded["large.0"] is contiguous and loaded["large.1"] is strided
    assert torch.equal(contiguous, state["large.0"])
    assert torch.equal(strided, state["large.1"])
    assert torch.count_nonzero(strided_storage[1::2]) == 0  # nothing written between the strides
    assert_state_equal(state, loaded)


def test_load_selected_keys(base_dir):
    state = make_state(2, small_tensors=5)
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state)
    loaded = load_version(base_dir, 1, keys=["small.3", "extra"])
    assert set(loaded) == {"small.3", "extra"}
    assert torch.equal(raw_bytes(loaded["small.3"]), raw_bytes(state["small.3"]))


def test_versions_are_listed_and_superseded_ones_deleted(base_dir):
    with CheckpointSaver(base_dir) as saver:
        for step in (10, 20, 30, 40):
            saver.save(step, make_state(step, small_tensors=3), keep=None, metadata={"note": f"s{step}"})
        assert [v.step for v in list_versions(base_dir)] == [10, 20, 30, 40]
        assert list_versions(base_dir)[0].record.metadata == {"note": "s10"}
        assert delete_superseded(base_dir, keep=2, rank=0, pool=saver.pool) == [10, 20]
        assert committed_steps(CheckpointLayout(base_dir)) == [30, 40]
        assert not (base_dir / "step-10").exists()
        assert_state_equal(make_state(30, small_tensors=3), load_version(base_dir, 30))
        with pytest.raises(ValueError, match="keep must be >= 1"):
            delete_superseded(base_dir, keep=0)


def test_steady_state_reuses_two_buffers(base_dir):
    """With keep=1 a save reuses the buffer of the version retired by the previous save: no new files."""
    with CheckpointSaver(base_dir) as saver:
        inodes = set()
        for step in range(1, 8):
            saver.save(step, make_state(step, small_tensors=3))
            obj = next((base_dir / f"step-{step}").glob("*.fpo"))
            inodes.add(os.stat(obj).st_ino)
        assert len(inodes) == 2
        assert committed_steps(CheckpointLayout(base_dir)) == [7]


def test_checksum_off_still_round_trips(base_dir):
    state = make_state(4, small_tensors=10)
    with CheckpointSaver(base_dir, checksum=False) as saver:
        saver.save(1, state)
    assert_state_equal(state, load_version(base_dir, 1))
    verify_version(base_dir, 1)


_DTYPES_FOR_PROPERTY = [torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.bool, torch.complex64,
                        torch.float8_e5m2, torch.uint8]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES_FOR_PROPERTY))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    tensor = random_tensor_of(dtype, shape, seed=draw(st.integers(0, 2**16)))
    if tensor.dim() >= 2 and draw(st.booleans()):
        tensor = tensor.transpose(0, 1)
    return tensor


state_dicts = st.dictionaries(
    st.text(min_size=1, max_size=12),
    st.one_of(tensors(), st.binary(max_size=64)),
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=state_dicts)
def test_random_state_dicts_round_trip(base_dir, state):
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, state, overwrite=True)
    assert_state_equal(state, load_version(base_dir, 1))


def test_cached_layout_is_revalidated_every_save(base_dir):
    """The saver reuses the previous layout only if keys, dtypes and shapes are all unchanged."""
    states = [
        {"a": torch.randn(4, 4), "b": torch.randn(3)},
        {"a": torch.randn(4, 4), "b": torch.randn(3)},  # same structure: cached layout
        {"a": torch.randn(2, 8), "b": torch.randn(3)},  # same bytes, other shape
        {"a": torch.randn(4, 4, dtype=torch.float64), "b": torch.randn(3)},  # other dtype
        {"b": torch.randn(3), "a": torch.randn(4, 4)},  # other order
        {"a": torch.randn(4, 4), "b": b"now bytes"},  # other kind
    ]
    with CheckpointSaver(base_dir) as saver:
        for step, state in enumerate(states):
            saver.save(step, state)
            assert_state_equal(state, load_version(base_dir, step))


# --- whole-object CRC32C from the index (replication sends it instead of reading the data) --------


def whole_file_crc(path: os.PathLike[str], nbytes: int) -> int:
    with open(path, "rb") as handle:
        return _core.crc32c(handle.read(nbytes))


def derived_crc(base_dir: os.PathLike[str], step: int) -> tuple[int | None, int]:
    """(CRC derived from header and index, CRC of the object's bytes) of the single object of step."""
    record = read_commit(CheckpointLayout(base_dir), step).objects[0]
    path = CheckpointLayout(base_dir).object_path(step, record.name)
    fd = os.open(path, os.O_RDONLY)
    try:
        return whole_object_crc32c(fd, str(path), record), whole_file_crc(path, record.nbytes)
    finally:
        os.close(fd)


def test_whole_object_crc_from_the_index_equals_the_crc_of_the_bytes(base_dir):
    """Every dtype, empty tensors, odd sizes, small and page-aligned large records, bytes records."""
    states = [
        {str(d): random_tensor_of(d, (3, 5), seed=i) for i, d in enumerate(storable_dtypes())},
        {"empty": torch.empty(0, 4), "odd": random_tensor_of(torch.uint8, (1001,)), "empty_bytes": b"",
         "big": random_tensor_of(torch.bfloat16, (3, 333_333)), "after_big": torch.empty(2, 0, 3),
         "scalar": torch.tensor(7, dtype=torch.int16), "bytes": b"\x00\x01binary\xff"},
        {"only_empty": torch.empty(0)},
        {f"t{i}": random_tensor_of(torch.float32, (i % 5 + 1, 3), seed=i) for i in range(300)},
    ]
    with CheckpointSaver(base_dir) as saver:
        for step, state in enumerate(states, start=1):
            saver.save(step, state)
            derived, actual = derived_crc(base_dir, step)
            assert derived == actual, f"step {step}"


def test_whole_object_crc_holds_in_reused_buffers_whose_layout_changed(base_dir):
    """A reused pool buffer holds earlier saves' bytes where the new layout has padding: it is zeroed."""
    layouts = [{"a": torch.randn(1 << 18), "b": torch.randn(999)},
               {"b": torch.randn(13), "a": torch.randn(1 << 18)},
               {"c": torch.randn(7), "d": torch.randn(5), "a": torch.randn((1 << 18) + 1)}]
    with CheckpointSaver(base_dir, max_free_buffers=1) as saver:
        for step, state in enumerate(layouts * 2, start=1):
            saver.save(step, state)
            derived, actual = derived_crc(base_dir, step)
            assert derived == actual, f"step {step}"


def test_whole_object_crc_is_none_without_checksums(base_dir):
    with CheckpointSaver(base_dir, checksum=False) as saver:
        saver.save(1, make_state(1, small_tensors=3))
    assert derived_crc(base_dir, 1)[0] is None


def test_whole_object_crc_is_none_for_objects_without_zeroed_padding_and_checks_the_record(base_dir):
    with CheckpointSaver(base_dir) as saver:
        saver.save(1, {"x": torch.randn(100)})
    layout = CheckpointLayout(base_dir)
    record = read_commit(layout, 1).objects[0]
    path = layout.object_path(1, record.name)
    with open(path, "rb") as handle:
        header_raw = handle.read(HEADER_NBYTES)
        header = ObjectHeader.decode(header_raw, str(path))
        handle.seek(header.index_offset)
        index_raw = handle.read(header.index_nbytes)
    unflagged = ObjectHeader(header.object_nbytes, header.index_offset, header.index_nbytes, header.index_crc32c,
                             header.record_count, header.writer_rank, flags=0).encode()
    assert object_crc32c_from_index(unflagged, index_raw, str(path)) is None  # an older writer's object
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptCheckpointError, match="commit record"):
            whole_object_crc32c(fd, str(path), dataclasses.replace(record, crc32c=record.crc32c ^ 1))
    finally:
        os.close(fd)


def fetched_object(base_dir, **saver_options) -> tuple:
    """(path, record) of a single-object version, as recovery has it once fetched from the holder's own object:
    a pool buffer, 4 MiB longer than the object (a replica is exactly as long)."""
    with CheckpointSaver(base_dir, **saver_options) as saver:
        saver.save(1, {"w": torch.randn(1 << 21), "b": torch.randn(33)})
    record = read_commit(CheckpointLayout(base_dir), 1).objects[0]
    return CheckpointLayout(base_dir).object_path(1, record.name), record


@pytest.fixture
def full_reads(monkeypatch):
    """Counts recovery's full verification passes over fetched objects (the real one still runs)."""
    from ml_flashpoint_nemo.replication import recovery

    calls = []
    full = recovery.verify_object

    def counted(path, record):
        calls.append(path)
        return full(path, record)

    monkeypatch.setattr(recovery, "verify_object", counted)
    return calls


def test_a_fetched_object_is_verified_from_its_received_crc_without_reading_its_data(base_dir, full_reads):
    from ml_flashpoint_nemo.replication.recovery import verify_fetched_object

    path, record = fetched_object(base_dir)
    assert os.path.getsize(path) > record.nbytes
    verify_fetched_object(path, record, whole_file_crc(path, os.path.getsize(path)))
    os.truncate(path, record.nbytes)  # as a replica is
    verify_fetched_object(path, record, whole_file_crc(path, record.nbytes))
    assert full_reads == []
    verify_fetched_object(path, record, whole_file_crc(path, record.nbytes) ^ 1)  # the CRCs disagree: read it all
    assert full_reads == [path]


def test_a_fetched_object_with_a_damaged_record_fails_by_key_although_its_crc_was_received_intact(base_dir, full_reads):
    """The bytes received are the peer's damaged copy: the received CRC is theirs, the index says otherwise."""
    from ml_flashpoint_nemo.errors import ChecksumError
    from ml_flashpoint_nemo.replication.recovery import verify_fetched_object

    path, record = fetched_object(base_dir)
    with open(path, "r+b") as handle:
        entry = next(e for e in open_object_entries(path, record) if e.key == "w")
        handle.seek(entry.offset + 5)
        byte = handle.read(1)
        handle.seek(entry.offset + 5)
        handle.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match="key 'w' .* fails its CRC32C"):
        verify_fetched_object(path, record, whole_file_crc(path, os.path.getsize(path)))
    assert full_reads == [path]


def test_a_fetched_object_whose_header_names_another_writer_is_refused_although_its_crcs_agree(base_dir, full_reads):
    """A header ends with its own CRC, so every self-consistent header adds the same CRC to the commit
    record's: the record cannot tell writers apart, the field check must (as the loader's does)."""
    from ml_flashpoint_nemo.replication.recovery import verify_fetched_object
    from tests.support.forge import forge_header

    path, record = fetched_object(base_dir)
    os.truncate(path, record.nbytes)
    forge_header(Path(path), lambda fields: fields.update(writer_rank=record.rank + 7))  # its own CRC recomputed
    with open(path, "rb") as handle:
        assert ObjectHeader.decode(handle.read(HEADER_NBYTES), path).writer_rank == record.rank + 7
    with pytest.raises(CorruptCheckpointError, match=f"writer rank {record.rank + 7}, .* says rank {record.rank}"):
        verify_fetched_object(path, record, whole_file_crc(path, record.nbytes))
    assert full_reads == [path]  # refused by the fast path, then named by the full check


@pytest.mark.parametrize("options", [{"checksum": False}], ids=["no-checksums"])
def test_a_fetched_object_whose_crc_does_not_follow_from_its_index_is_read_in_full(base_dir, full_reads, options):
    from ml_flashpoint_nemo.replication.recovery import verify_fetched_object

    path, record = fetched_object(base_dir, **options)
    verify_fetched_object(path, record, whole_file_crc(path, os.path.getsize(path)))
    assert full_reads == [path]


def open_object_entries(path, record) -> list:
    from ml_flashpoint_nemo.core.loader import open_object

    with open_object(str(path), record) as obj:
        return list(obj.entries)


@pytest.mark.parametrize("steps, committed, keep, expected", [
    ([], [], 1, []),
    ([1, 2, 3], [], 1, []),  # nothing committed: every directory may be a save in progress
    ([1, 2, 3], [1, 2, 3], 1, [1, 2]),
    ([1, 2, 3], [1, 2, 3], 5, []),
    ([1, 2, 3, 4, 9], [1, 3, 4], 2, [1, 2]),  # 2: an older uncommitted leftover; 9: newer, may be being written
    ([5, 1, 3, 3], [3, 1, 5], 1, [1, 3]),  # any order, duplicates
])
def test_superseded_steps_is_the_retention_policy(steps, committed, keep, expected):
    from ml_flashpoint_nemo.core.versions import superseded_steps

    assert superseded_steps(steps, committed, keep=keep) == expected


def test_superseded_steps_never_lets_the_newest_committed_version_go():
    from ml_flashpoint_nemo.core.versions import superseded_steps

    with pytest.raises(ValueError, match="keep must be >= 1"):
        superseded_steps([1, 2], [1, 2], keep=0)


# --- states of plain CPU tensors take the column path (values.tensor_columns) -------------------


def test_tensor_columns_take_only_plain_dense_contiguous_cpu_tensors():
    plain = {"a": torch.randn(3, 4), "p": torch.nn.Parameter(torch.randn(2)), "e": torch.empty(0)}
    columns = tensor_columns(plain)
    assert columns is not None
    assert columns.keys == ["a", "p", "e"]
    assert columns.dtypes == [torch.float32] * 3
    assert [tuple(s) for s in columns.shapes] == [(3, 4), (2,), (0,)]
    assert columns.nbytes == [48, 8, 0]
    assert list(columns.addresses) == [t.data_ptr() for t in plain.values()]
    assert columns.signature() == [("a", "tensor", "float32", (3, 4), 48), ("p", "tensor", "float32", (2,), 8),
                                   ("e", "tensor", "float32", (0,), 0)]
    complex_values = torch.randn(4, dtype=torch.complex64)
    for odd in (b"bytes", torch.randn(4, 4).t(), complex_values.conj(), torch._neg_view(torch.randn(3)),
                torch.empty(3, device="meta"), torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
                torch.randn(3, 3).to_sparse(), memoryview(b"xy")):
        assert tensor_columns({"a": torch.randn(2), "odd": odd}) is None, odd
    assert tensor_columns({1: torch.randn(2)}) is None  # type: ignore[dict-item]
    assert tensor_columns([("a", torch.randn(2))]) is None  # type: ignore[arg-type]


def test_the_column_and_per_value_paths_share_one_cached_layout_safely(base_dir):
    """Saves alternate between the two paths and change the structure under both; each loads bit-exact."""
    a, b = torch.randn(4, 4), torch.randn(3)
    states = [
        {"a": a, "b": b},  # columns
        {"a": a, "b": b"now bytes"},  # per value: another layout
        {"a": a, "b": b},  # columns again: the layout of the bytes save must not be reused
        {"a": a.t(), "b": b},  # per value (strided), same layout as the columns save before
        {"a": torch.randn(4, 4), "b": torch.randn(3)},  # columns: same layout, new tensors, new addresses
        {"a": torch.randn(2, 8), "b": torch.randn(3)},  # columns: same bytes, other shape
        {"b": torch.randn(3), "a": torch.randn(2, 8)},  # columns: other order
    ]
    with CheckpointSaver(base_dir) as saver:
        for step, state in enumerate(states):
            saver.save(step, state)
            assert_state_equal(state, load_version(base_dir, step))


def test_tensors_changed_in_place_between_saves_are_saved_as_they_are_now(base_dir):
    """The same tensor objects every save (as a trainer's parameters are), changed in place in ways
    that keep or change the layout: values, shape (resize_), dtype and storage (.data =)."""
    weight, bias = torch.randn(4, 4), torch.randn(4)
    state = {"weight": weight, "bias": bias}
    with CheckpointSaver(base_dir) as saver:
        saver.save(0, state)
        weight.add_(1.0)
        saver.save(1, state)
        assert_state_equal({"weight": weight, "bias": bias}, load_version(base_dir, 1))
        weight.resize_(2, 8)
        saver.save(2, state)
        assert load_version(base_dir, 2)["weight"].shape == (2, 8)
        bias.data = torch.arange(6, dtype=torch.float64)
        saver.save(3, state)
        loaded = load_version(base_dir, 3)
        assert loaded["bias"].dtype == torch.float64 and torch.equal(loaded["bias"], torch.arange(6, dtype=torch.float64))
        assert_state_equal({"weight": weight, "bias": bias}, loaded)


def test_no_garbage_collection_runs_while_a_save_stages(base_dir):
    """A collection of a large heap in the middle of the staging copy is time training waits for;
    the pause defers it to the next allocation after the staging."""
    state = {f"t{i}": torch.randn(8) for i in range(500)}
    staging = {"tensor_columns", "prepare_state", "_plan_for", "_plan_for_columns", "_copy_columns", "_copy_values"}
    collections_inside: list[str] = []

    def during_collection(phase: str, info: dict) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name in staging:
                collections_inside.append(f"{phase} in {frame.f_code.co_name}")
                return
            frame = frame.f_back

    thresholds = gc.get_threshold()
    gc.set_threshold(1)  # a collection at nearly every allocation, unless paused
    gc.callbacks.append(during_collection)
    try:
        with CheckpointSaver(base_dir) as saver:
            for step in range(3):
                saver.save(step, state)
                saver.save(step + 10, {**state, "extra": b"bytes"})  # the per-value path too
    finally:
        gc.callbacks.remove(during_collection)
        gc.set_threshold(*thresholds)
    assert collections_inside == []


@settings(max_examples=200, deadline=None)
@given(key=st.text(max_size=20), kind=st.sampled_from(["tensor", "bytes"]), dtype=st.text(max_size=8),
       shape=st.lists(st.integers(0, 2**40), max_size=4), offset=st.integers(0, 2**62), nbytes=st.integers(0, 2**62))
def test_an_index_record_is_the_json_that_json_dumps_writes(key, kind, dtype, shape, offset, nbytes):
    entry = IndexEntry(key, kind, dtype, tuple(shape), offset, nbytes)
    fields = {"key": key, "kind": kind, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes}
    assert entry.json_without_crc() == json.dumps(fields, separators=(",", ":"), ensure_ascii=False)[:-1]


@settings(max_examples=200, deadline=None)
@given(records=st.lists(st.tuples(st.text(max_size=12), st.lists(st.integers(0, 2**40), max_size=3),
                                  st.integers(0, 2**62), st.integers(0, 2**32 - 1)), max_size=6))
def test_a_filled_index_template_is_the_json_that_json_dumps_writes(records):
    """The template's CRC slots are byte offsets: right also for keys that JSON escapes or UTF-8 widens."""
    entries = [IndexEntry(key, "tensor", "float32", tuple(shape), offset, 4) for key, shape, offset, _ in records]
    crcs = [crc for *_, crc in records]
    expected = {"format_version": FORMAT_VERSION, "records": [
        {"key": key, "kind": "tensor", "dtype": "float32", "shape": shape, "offset": offset, "nbytes": 4,
         "crc32c": f"{crc:08x}"} for key, shape, offset, crc in records]}
    assert IndexTemplate(entries).fill(crcs) == json.dumps(expected, separators=(",", ":"),
                                                            ensure_ascii=False).encode("utf-8")
