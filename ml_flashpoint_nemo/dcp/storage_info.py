"""How a DCP item maps to a record of a flashpoint object, and how versions are named.

Two forms, both plain tuples (pickled in C, not through a class's reduce):
- WrittenItem, a WriteResult's storage_data: the object's record and the record key. DCP
  gathers these from every rank; the coordinator lists the records in the commit record.
- ItemLocation, the storage_data kept in `.metadata`: the object's file name and the record
  key, plain strings, so `.metadata` unpickles with torch alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from ml_flashpoint_nemo.core.format import ObjectRecord
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.errors import BaseDirError, CorruptCheckpointError

DCP_METADATA_NAME = ".metadata"
_STEP_NAME = re.compile(r"^step-(\d+)$")

WrittenItem = tuple[ObjectRecord, str]  # (record of the object holding the item, record key)
ItemLocation = tuple[str, str]  # (object file name, record key)


def item_location(value: Any, index: MetadataIndex, step: int | None) -> ItemLocation:
    """value, one storage_data entry read from `.metadata`, checked to be an ItemLocation."""
    if type(value) is tuple and len(value) == 2 and type(value[0]) is str and type(value[1]) is str:
        return value
    raise CorruptCheckpointError(
        f"the storage data of {index.fqn} in version {step} is {type(value).__name__}, not (object name, record "
        "key): the version was not written by this ml_flashpoint_nemo. Load an older version, or the durable "
        "checkpoint, and save again."
    )


def record_key(index: MetadataIndex) -> str:
    """A unique record key per DCP item: the fully qualified name plus the chunk offset."""
    offset = index.offset
    if offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(map(str, offset))}"


def step_of_checkpoint_id(layout: CheckpointLayout, checkpoint_id: str | os.PathLike[str]) -> int:
    """The step of checkpoint_id, which must be <base_dir>/step-<N> (checked on real paths, not strings)."""
    path = Path(checkpoint_id).absolute()
    match = _STEP_NAME.match(path.name)
    if match is None or os.path.realpath(path.parent) != os.path.realpath(layout.base_dir):
        raise BaseDirError(
            f"checkpoint_id {str(checkpoint_id)!r} is not of the form {layout.base_dir}/step-<N>: flashpoint "
            "versions live directly in the base directory the writer/reader was created with."
        )
    return int(match.group(1))
