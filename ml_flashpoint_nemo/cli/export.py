"""`flashpoint export BASE STEP DEST`: write a RAM version as a standard torch DCP checkpoint directory.

The result loads with ``dcp.load(state_dict, storage_reader=FileSystemReader(DEST))`` (no process
group needed), bit-exact. Every byte is read through the flashpoint loader, so it is verified
against its CRC32C before anything is written; a failure leaves no DEST behind.

Mapping:
- DCP-kind versions (saved through MemoryStorageWriter or the Megatron strategy): the same keys
  (fully qualified names), global shapes, dtypes and chunks (sharding offsets) as the original
  DCP metadata; bytes items (pickled Python objects) are copied verbatim, never unpickled. The
  original planner data (how nested state dicts were flattened) is kept. Other version files
  the commit record lists besides `.metadata` (Megatron's common.pt) are copied verbatim, except
  metadata.json, which names the flashpoint Megatron backend and would misdirect a Megatron load.
- core-kind versions (CheckpointSaver, per-rank state dicts): a version holding one rank's state
  keeps its plain keys; with several ranks every key becomes "rank{R}/{key}". Tensors are stored
  whole; bytes records come back as Python `bytes` values.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import signal
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ml_flashpoint_nemo.cli.common import (
    EXIT_OK,
    CliError,
    human_bytes,
    open_base,
    parse_step,
)
from ml_flashpoint_nemo.core.layout import DCP_METADATA_NAME, MEGATRON_CONFIG_NAME
from ml_flashpoint_nemo.core.versions import fsync_directory
from ml_flashpoint_nemo.dcp.conversion import (
    Read,
    fill_sizes,
    make_planner,
    offset_key,
    plan_core_version,
    plan_dcp_version,
)

if TYPE_CHECKING:  # torch and the rest of the core are imported by the commands that need them
    import torch

    from ml_flashpoint_nemo.core.format import CommitRecord
    from ml_flashpoint_nemo.core.layout import CheckpointLayout

_READ_BATCH_BYTES = 64 << 20  # progress granularity: records are read in batches of about this size
_SKIPPED_VERSION_FILES = {DCP_METADATA_NAME, MEGATRON_CONFIG_NAME}


class Progress:
    """A one-line text progress bar on stderr (no dependency); silent when disabled."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0
        self._drawn = -1

    def advance(self, nbytes: int, *, force: bool = False) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        self._drawn = self.done
        fraction = min(self.done / self.total, 1.0)
        width = 30
        bar = "#" * int(fraction * width)
        rate = self.done / max(now - self.start, 1e-9)
        sys.stderr.write(f"\r{self.label} [{bar:<{width}}] {fraction * 100:5.1f}% "
                         f"{human_bytes(self.done)}/{human_bytes(self.total)} {human_bytes(int(rate))}/s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            if self._drawn != self.done:
                self.advance(0, force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()


def _read_all(layout: CheckpointLayout, commit: CommitRecord, per_object: dict[str, list[Read]], raw_bytes: bool,
              progress: Progress, threads: int | None) -> dict[tuple[str, tuple[int, ...] | None], torch.Tensor | bytes]:
    """Every record, read and verified: {(fqn, offset): tensor | serialized bytes}."""
    import torch

    from ml_flashpoint_nemo.core.loader import open_object, read_object
    from ml_flashpoint_nemo.errors import CorruptCheckpointError

    records = {o.name: o for o in commit.objects}
    data: dict[tuple[str, tuple[int, ...] | None], torch.Tensor | bytes] = {}
    for name, reads in per_object.items():
        if name == "":
            data.update({(r.fqn, r.offset): r.tensor for r in reads if r.tensor is not None})  # empty chunks
            continue
        if name not in records:
            raise CorruptCheckpointError(f"object {name} is not listed in the commit record of step {commit.step}")
        with open_object(str(layout.object_path(commit.step, name)), records[name]) as obj:
            batch: list[Read] = []
            batch_bytes = 0
            for i, read in enumerate(reads):
                batch.append(read)
                batch_bytes += read.nbytes
                if batch_bytes < _READ_BATCH_BYTES and i + 1 < len(reads):
                    continue
                into = {r.key: r.tensor for r in batch if r.tensor is not None}
                keys = [r.key for r in batch if r.tensor is None]
                loaded = read_object(obj, into=into, keys=keys, threads=threads)
                for r in batch:
                    if r.tensor is not None:
                        data[(r.fqn, r.offset)] = r.tensor
                    elif raw_bytes:  # a DCP bytes item: already torch.save'd by DCP, copied verbatim
                        data[(r.fqn, r.offset)] = bytes(loaded[r.key])
                    else:  # a core bytes record: stored as a Python bytes value
                        stream = io.BytesIO()
                        torch.save(bytes(loaded[r.key]), stream)
                        data[(r.fqn, r.offset)] = stream.getvalue()
                progress.advance(batch_bytes)
                batch, batch_bytes = [], 0
    return data


def export_version(base: str, step: int, dest_dir: Path, *, threads: int | None, progress_enabled: bool) -> dict:
    """Write version `step` of base into dest_dir (an empty directory); returns a summary."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ml_flashpoint_nemo.core.layout import CheckpointLayout
    from ml_flashpoint_nemo.core.version_files import read_checked_file
    from ml_flashpoint_nemo.core.versions import read_commit

    layout = CheckpointLayout(base)
    commit = read_commit(layout, step)
    is_dcp = commit.metadata.get("kind") == "dcp"
    plan = plan_dcp_version if is_dcp else plan_core_version
    per_object, items, planner_data, original, raw_bytes = plan(layout, commit)
    fill_sizes(layout, commit, per_object)
    total = sum(r.nbytes for reads in per_object.values() for r in reads)
    progress = Progress(2 * total, f"export step {step}", progress_enabled)
    try:
        data = _read_all(layout, commit, per_object, raw_bytes, progress, threads)
        planner = make_planner(items, lambda item: data[(item.index.fqn, offset_key(item.index.offset))],
                               planner_data, original, lambda n: progress.advance(n if n else 0))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            warnings.filterwarnings("ignore", message=".*no_dist.*")
            dcp.save({}, storage_writer=FileSystemWriter(str(dest_dir)), planner=planner, no_dist=True)
    finally:
        progress.close()
    copied = []
    if is_dcp:
        for name in sorted(commit.metadata.get("files") or {}):
            if name in _SKIPPED_VERSION_FILES:
                continue
            (dest_dir / name).write_bytes(read_checked_file(layout, commit, name))
            copied.append(name)
    tensors = sum(1 for i in items if i.tensor_data is not None)
    return {"step": step, "kind": "dcp" if is_dcp else "core", "items": len(items),
            "tensor_chunks": tensors, "bytes_items": len(items) - tensors,
            "keys": len({i.index.fqn for i in items}), "nbytes": total, "copied_files": copied}


def _prepare_dest(dest: Path, layout: CheckpointLayout, force: bool) -> bool:
    """Check DEST can be written; returns whether something is there to replace."""
    if not dest.parent.is_dir():
        raise CliError(f"the parent of DEST, {dest.parent}, is not an existing directory")
    base = os.path.realpath(layout.base_dir)
    real = os.path.realpath(dest)
    if real == base or real.startswith(base.rstrip("/") + "/"):
        raise CliError(f"DEST {dest} lies inside the base directory {layout.base_dir}; export elsewhere")
    if not (dest.exists() or dest.is_symlink()):
        return False
    if dest.is_dir() and not dest.is_symlink() and not any(os.scandir(dest)):
        return True  # an empty directory: replaced by the rename
    if not force:
        raise CliError(f"DEST {dest} exists and is not empty; pass --force to replace it")
    return True


def run(args: argparse.Namespace) -> int:
    from ml_flashpoint_nemo.core.layout import not_private_problem
    from ml_flashpoint_nemo.core.versions import committed_steps

    layout = open_base(args.base)
    unsafe = not_private_problem(layout.base_dir)
    if unsafe is not None:  # the export would hand on whatever another user planted there
        raise CliError(f"not exported: {unsafe}")
    step = parse_step(args.step)
    committed = committed_steps(layout)
    if step not in committed:
        state = "is not committed" if step in layout.version_steps() else "does not exist"
        raise CliError(f"version {step} in {layout.base_dir} {state}; committed steps: {committed}")
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be >= 1")
    dest = Path(args.dest).absolute()
    replace = _prepare_dest(dest, layout, args.force)
    temporary = dest.parent / f"{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    progress = args.progress or sys.stderr.isatty()
    try:  # SIGTERM unwinds, so the finally below removes the temporary directory
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (main() called from a thread): keep the handler as it is
        previous = None
    temporary.mkdir()
    try:
        summary = export_version(str(layout.base_dir), step, temporary, threads=args.threads,
                                 progress_enabled=progress)
        fsync_directory(temporary)
        if replace:
            _replace(temporary, dest)
        else:
            os.rename(temporary, dest)
        fsync_directory(dest.parent)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(temporary, ignore_errors=True)
    print(f"exported step {step} ({summary['kind']}: {summary['keys']} keys, {summary['tensor_chunks']} tensor "
          f"chunks, {summary['bytes_items']} bytes items, {human_bytes(summary['nbytes'])}) to {dest}"
          + (f"; copied {', '.join(summary['copied_files'])}" if summary["copied_files"] else ""))
    return EXIT_OK


def _replace(temporary: Path, dest: Path) -> None:
    """Put temporary in dest's place: an empty directory is replaced by the rename, anything else moved aside."""
    if dest.is_dir() and not dest.is_symlink() and not any(os.scandir(dest)):
        os.rename(temporary, dest)
        return
    aside = dest.parent / f"{dest.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(dest, aside)
    try:
        os.rename(temporary, dest)
    except BaseException:
        os.rename(aside, dest)
        raise
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)

