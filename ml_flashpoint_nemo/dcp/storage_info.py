"""How a DCP item maps to a record of a flashpoint object, and how versions are named.

Two forms, both plain tuples (pickled in C, not through a class's reduce):
- RankWrite, the storage_data of the one WriteResult a rank's write_data returns: the object's
  name and record, and the record key and DCP index of each of its items, in plan order. One
  result per rank rather than one per item: DCP only gathers the results and hands them to
  finish(), which is ours, and 500 WriteResult objects cost more to build and to gather than
  the tuples they would carry. The coordinator lists the records in the commit record.
- ItemLocation, the storage_data kept in `.metadata` per item: the object's file name and the
  record key, plain strings, so `.metadata` unpickles with torch alone.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from ml_flashpoint_nemo.core.format import ObjectRecord
from ml_flashpoint_nemo.core.layout import DCP_METADATA_NAME, CheckpointLayout, step_of_version_dir
from ml_flashpoint_nemo.errors import BaseDirError, CorruptCheckpointError

__all__ = ["DCP_METADATA_NAME", "CheckpointIdCheck", "ItemLocation", "RankWrite", "item_location", "record_key",
           "record_key_of", "step_of_checkpoint_id"]

ItemLocation = tuple[str, str]  # (object file name, record key)
# (object file name, object record, record key per item, DCP index per item), items in plan order
RankWrite = tuple[str, ObjectRecord, tuple[str, ...], tuple[MetadataIndex, ...]]


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
    return record_key_of(index.fqn, index.offset)


@functools.lru_cache(maxsize=1 << 16)
def record_key_of(fqn: str, offset: tuple[int, ...] | None) -> str:
    """record_key of the item (fqn, offset); cached, as a job saves the same items every time."""
    if offset is None:
        return fqn
    return f"{fqn}@{','.join(map(str, offset))}"


def step_of_checkpoint_id(layout: CheckpointLayout | None, checkpoint_id: Any) -> int:
    """The step of checkpoint_id, the one rule for what a checkpoint id is: a local path <base_dir>/step-<N>.

    N is written canonically (step-7, not step-07), a trailing slash is allowed, a URL (file://...) is not.
    With a layout, the parent must be its base directory (real paths compared, symlinks resolved).
    """
    if not isinstance(checkpoint_id, (str, os.PathLike)) or "://" in os.fspath(checkpoint_id):
        raise BaseDirError(
            f"checkpoint_id {checkpoint_id!r} is not a local path {_expected(layout)}: pass a path, not a URL"
        )
    path = Path(checkpoint_id).absolute()  # "<base>/step-1/" names step-1
    step = step_of_version_dir(path.name)  # canonical only, as CheckpointLayout.version_dir names it
    # The same absolute text names the same directory; only other spellings need their real paths (syscalls).
    if step is None or (layout is not None and path.parent != layout.base_dir
                        and os.path.realpath(path.parent) != os.path.realpath(layout.base_dir)):
        raise BaseDirError(
            f"checkpoint_id {os.fspath(checkpoint_id)!r} is not of the form {_expected(layout)}: flashpoint "
            "versions live directly in the base directory the writer/reader was created with."
        )
    return step


def _expected(layout: CheckpointLayout | None) -> str:
    return f"{layout.base_dir if layout is not None else '<base_dir>'}/step-<N>"


class CheckpointIdCheck:
    """validate_checkpoint_id of the writer and reader, deciding as their reset() does.

    On the class (DCP's storage auto-detection) it checks the form <dir>/step-<N>; on an
    instance it also checks the directory is that writer's or reader's base directory.
    """

    def __get__(self, instance: Any, owner: type) -> Any:
        layout = getattr(instance, "layout", None) if instance is not None else None

        def validate_checkpoint_id(checkpoint_id: Any) -> bool:
            try:
                step_of_checkpoint_id(layout, checkpoint_id)
            except BaseDirError:
                return False
            return True

        return validate_checkpoint_id
