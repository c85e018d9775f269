"""A DCP `.metadata` that lies with valid checksums is refused before a byte is loaded.

`.metadata` is a pickle, and may come from a peer (recovery fetches version files): unpickling it
must run nothing but the constructors DCP metadata is made of, and what it says must agree with
the stored records. Each version here is re-committed with the forged file's checksum, so only
these checks, not a CRC, can catch the lie; the version saved before it still loads.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ml_flashpoint_nemo.core import verify_version
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.version_files import FILES_KEY, describe_bytes
from ml_flashpoint_nemo.core.versions import read_commit, write_commit
from ml_flashpoint_nemo.dcp import MemoryStorageReader, MemoryStorageWriter
from ml_flashpoint_nemo.dcp.metadata_file import checked_chunks, unpickle_metadata
from ml_flashpoint_nemo.errors import CorruptCheckpointError

OBJECT = "rank-00000-0.fpo"


def save(base_dir: Path, step: int, state: dict[str, Any]) -> None:
    writer = MemoryStorageWriter(base_dir)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=base_dir / f"step-{step}", storage_writer=writer)
    writer.close()


def load(base_dir: Path, step: int, dest: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(dest, checkpoint_id=base_dir / f"step-{step}", storage_reader=MemoryStorageReader(base_dir))


def replace_metadata(base_dir: Path, step: int, encoded: bytes) -> None:
    """Write encoded as the version's `.metadata` and re-commit the version with its checksum."""
    layout = CheckpointLayout(base_dir)
    (base_dir / f"step-{step}" / ".metadata").write_bytes(encoded)
    commit = read_commit(layout, step)
    files = dict(commit.metadata[FILES_KEY], **{".metadata": describe_bytes(encoded)})
    write_commit(layout, step, commit.objects, world_size=commit.world_size, metadata={**commit.metadata,
                                                                                         FILES_KEY: files})


def saved_metadata(base_dir: Path, step: int) -> Metadata:
    return pickle.loads((base_dir / f"step-{step}" / ".metadata").read_bytes())


def assert_older_version_loads(base_dir: Path, state: dict[str, torch.Tensor]) -> None:
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    load(base_dir, 1, dest)
    assert all(torch.equal(dest[k], v) for k, v in state.items())


def two_chunks(shape: tuple[int, ...], first: tuple[tuple[int, ...], tuple[int, ...]],
               second: tuple[tuple[int, ...], tuple[int, ...]], dtype: torch.dtype = torch.float32) -> Metadata:
    """A Metadata of one tensor "w" of shape stored as two chunks ((offsets, sizes) each)."""
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in (first, second)]
    return Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)},
                    storage_data={})


# --- chunks must tile their tensor exactly -----------------------------------------------------------


def test_overlapping_chunks_whose_volumes_add_up_are_refused(base_dir):
    """Rows 0-1 and 1-2 of a 4x3 tensor hold 12 elements, as many as the tensor: row 3 would stay stale."""
    older = {"w": torch.randn(4, 3)}
    save(base_dir, 1, older)
    top, middle = torch.randn(2, 3), torch.randn(2, 3)
    save(base_dir, 2, {"top": top, "middle": middle})
    metadata = saved_metadata(base_dir, 2)
    metadata.state_dict_metadata = {"w": TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([4, 3]),
        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
         ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([2, 3]))])}
    metadata.storage_data = {MetadataIndex("w", [0, 0]): (OBJECT, "top@0,0"),
                             MetadataIndex("w", [1, 0]): (OBJECT, "middle@0,0")}
    metadata.planner_data = None
    replace_metadata(base_dir, 2, pickle.dumps(metadata))

    dest = {"w": torch.full((4, 3), 7.0)}
    with pytest.raises((CorruptCheckpointError, CheckpointException),
                       match=re.escape("lists chunks of w that overlap: [2, 3] at [0, 0] and [2, 3] at [1, 0]")):
        load(base_dir, 2, dest)
    assert bool((dest["w"] == 7).all()), "nothing is loaded from a refused version"
    assert verify_version(base_dir, 2).records == 2  # the objects themselves are intact
    assert_older_version_loads(base_dir, older)


@pytest.mark.parametrize("shape, first, second, message", [
    ((8, 4), ((0, 0), (4, 4)), ((4, 0), (4, 4)), None),  # cut along dim 0
    ((4, 8), ((0, 4), (4, 4)), ((0, 0), (4, 4)), None),  # cut along dim 1, listed out of order
    ((4, 0), ((0, 0), (2, 0)), ((2, 0), (2, 0)), None),  # a tensor of no elements
    ((8, 4), ((0, 0), (4, 4)), ((3, 0), (5, 4)), "holding 36 elements, but the tensor [8, 4] has 32"),
    ((8, 4), ((0, 0), (4, 4)), ((2, 0), (4, 4)), "that overlap: [4, 4] at [0, 0] and [4, 4] at [2, 0]"),
    ((4, 4), ((0, 0), (4, 2)), ((0, 1), (2, 2)), "holding 12 elements, but the tensor [4, 4] has 16"),
    ((8, 4), ((0, 0), (4, 4)), ((0, 0), (4, 4)), "that overlap"),  # one chunk listed twice
    ((8, 4), ((0, 0), (4, 4)), ((6, 0), (4, 4)), "outside the tensor's shape [8, 4]"),
    ((8,), ((0,), (8,)), ((8,), (0,)), None),  # an empty chunk at the end overlaps nothing
    ((8,), ((0,), (8,)), ((0,), (0,)), "two chunks of w at [0], of sizes [8] and [0]"),
    ((0, 1 << 63), ((0, 0), (0, 1 << 63)), ((0, 1), (0, 0)), "of a shape torch can hold"),
])
def test_chunks_are_checked_to_tile_their_tensor_exactly(shape, first, second, message):
    metadata = two_chunks(shape, first, second)
    if message is None:
        assert set(checked_chunks(metadata, 1)) == {("w", first[0]), ("w", second[0])}
    else:
        with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
            checked_chunks(metadata, 1)


def test_the_tiling_check_finds_an_overlap_in_a_grid_of_chunks():
    """A 4x4 grid of 2x2 chunks, one of them moved by one row onto its neighbour (volumes still add up)."""
    chunks = [ChunkStorageMetadata(torch.Size([2 * a, 2 * b]), torch.Size([2, 2])) for a in range(4) for b in range(4)]
    good = Metadata({"w": TensorStorageMetadata(TensorProperties(), torch.Size([8, 8]), chunks)}, storage_data={})
    assert len(checked_chunks(good, 1)) == 16
    chunks[5] = ChunkStorageMetadata(torch.Size([3, 2]), torch.Size([2, 2]))
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        checked_chunks(good, 1)


# --- the stored record must be the chunk the metadata describes ----------------------------------------


@pytest.mark.parametrize("lie", ["dtype", "shape"])
def test_metadata_that_describes_a_record_of_another_dtype_or_shape_is_refused(base_dir, lie):
    """Loaded through a copy, a float32 record under metadata saying float64 would be converted silently."""
    older = {"w": torch.randn(4, 3)}
    save(base_dir, 1, older)
    save(base_dir, 2, {"w": torch.randn(4, 3)})
    metadata = saved_metadata(base_dir, 2)
    stored = metadata.state_dict_metadata["w"]
    if lie == "dtype":
        stored.properties = TensorProperties(dtype=torch.float64)
        dest = {"w": torch.zeros(4, 3, dtype=torch.float64)}
        message = "holds [4, 3] elements but the DCP metadata of version 2 says [4, 3] (float32 stored, float64 in " \
                  "the metadata)"
    else:
        stored.size = torch.Size([3, 4])
        stored.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4]))]
        dest = {"w": torch.zeros(3, 4)}
        message = "holds [4, 3] elements but the DCP metadata of version 2 says [3, 4] (float32 stored, float32 in " \
                  "the metadata)"
    replace_metadata(base_dir, 2, pickle.dumps(metadata))
    with pytest.raises((CorruptCheckpointError, CheckpointException),
                       match=re.escape("w (offset [0, 0], record 'w@0,0'): the record in ") + ".*" + re.escape(message)):
        load(base_dir, 2, dest)
    assert not dest["w"].any()
    assert_older_version_loads(base_dir, older)


# --- `.metadata` runs nothing when it is unpickled -----------------------------------------------------


class Payload:
    """Unpickling it calls `function(*args)`: what a hostile `.metadata` would carry."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.function, self.args


def payloads(marker: Path) -> dict[str, tuple[Any, str]]:
    import os

    return {
        "exec": (Payload(exec, f"open({str(marker)!r}, 'w').close()"), "builtins.exec"),
        "os.system": (Payload(os.system, f"touch {marker}"), "posix.system"),
        "open": (Payload(open, str(marker), "w"), "io.open"),
        "a torch function": (Payload(torch.save, {}, str(marker)), "torch.serialization.save"),
    }


@pytest.mark.parametrize("where", ["planner_data", "storage_data", "an item"])
@pytest.mark.parametrize("kind", ["exec", "os.system", "open", "a torch function"])
def test_a_payload_in_the_metadata_is_refused_unrun(base_dir, tmp_path, kind, where):
    older = {"w": torch.randn(4, 3)}
    save(base_dir, 1, older)
    save(base_dir, 2, {"w": torch.randn(4, 3)})
    marker = tmp_path / "ran"
    payload, name = payloads(marker)[kind]
    metadata = saved_metadata(base_dir, 2)
    if where == "planner_data":
        metadata.planner_data = {"w": payload}
    elif where == "storage_data":
        metadata.storage_data = {index: payload for index in metadata.storage_data}
    else:
        metadata.state_dict_metadata["extra"] = payload
    replace_metadata(base_dir, 2, pickle.dumps(metadata))
    dest = {"w": torch.zeros(4, 3)}
    with pytest.raises((CorruptCheckpointError, CheckpointException),
                       match=re.escape(f"the DCP metadata of version 2 does not unpickle here: it names {name}, which "
                                       "DCP metadata is not made of, and was refused unrun")):
        load(base_dir, 2, dest)
    assert not marker.exists(), "the payload ran"
    assert not dest["w"].any()
    assert_older_version_loads(base_dir, older)


def _build_on(shared: bytes, state: bytes) -> bytes:
    """A pickle that names a shared object, then BUILDs it with state (opcodes, protocol 2)."""
    return b"\x80\x02" + shared + state + b"b."  # b: BUILD


SHARED_CHANGES = {
    # setattr(ChunkStorageMetadata, "__eq__", torch.Size) through BUILD's (state, slot state) form
    "a class attribute": (
        b"ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\n",
        b"N}X\x06\x00\x00\x00__eq__ctorch\nSize\ns\x86",
        lambda: ChunkStorageMetadata.__eq__ is torch.Size, "attribute __eq__ of <class"),
    # The Enum member TensorProperties decodes channels_last from, given another value
    "an Enum member": (
        b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x01\x85R",
        b"}X\x07\x00\x00\x00_value_K\x00s",
        lambda: _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST.value == 0, "attribute _value_ of <_MEM_FORMAT_ENCODING"),
}


@pytest.mark.parametrize("target", list(SHARED_CHANGES))
def test_a_metadata_that_changes_a_shared_class_is_refused_and_the_change_put_back(target):
    shared, state, changed, message = SHARED_CHANGES[target]
    encoded = _build_on(shared, state)
    pickletools.dis(encoded, io.StringIO())  # a well-formed pickle
    with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
        unpickle_metadata(encoded, 2)
    assert not changed(), "the change outlived the refused load"
    assert TensorProperties(memory_format=torch.channels_last).__getstate__()[3].value == 1


def test_a_layout_is_decoded_without_torchs_own_lookup_function():
    """torch pickles a layout as torch.serialization._get_layout(name); that function keeps a cache a pickle
    could set. The metadata is decoded with a lookup that has no attributes, and answers the same."""
    properties = TensorProperties(dtype=torch.bfloat16, layout=torch.strided, memory_format=torch.channels_last)
    encoded = pickle.dumps(properties, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"_get_layout" in encoded
    decoded = unpickle_metadata(encoded, 1)
    assert decoded == properties and decoded.layout is torch.strided
    state = b"}X\x05\x00\x00\x00cacheK\x00s"  # _get_layout.__dict__["cache"] = 0
    with pytest.raises(CorruptCheckpointError, match="does not unpickle here"):
        unpickle_metadata(_build_on(b"ctorch.serialization\n_get_layout\n", state), 1)
    from torch.serialization import _get_layout

    assert isinstance(_get_layout.cache, dict)  # type: ignore[attr-defined]


def test_every_name_a_real_save_pickles_is_admitted(base_dir):
    """Every dtype, a bytes item, an empty and a 0-d tensor, a channels-last tensor and planner data: the
    restricted unpickler decodes what pickle itself does."""
    state: dict[str, Any] = {str(dtype).removeprefix("torch."): torch.zeros(2, dtype=dtype) for dtype in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
        torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn)}
    state.update(empty=torch.zeros(0, 4), scalar=torch.tensor(3), extra={"note": [1, 2.5, "x"]},
                 cl=torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
    save(base_dir, 1, state)
    encoded = (base_dir / "step-1" / ".metadata").read_bytes()
    assert unpickle_metadata(encoded, 1) == pickle.loads(encoded)
