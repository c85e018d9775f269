"""How a DCP item maps to a record of a flashpoint object, and how versions are named."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.metadata import MetadataIndex

from ml_flashpoint_nemo.core.format import ObjectRecord
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.errors import BaseDirError

DCP_METADATA_NAME = ".metadata"
_STEP_NAME = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class FlashpointStorageInfo:
    """DCP storage_data of one item: the object holding it and the record key inside."""

    object: ObjectRecord
    key: str


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
