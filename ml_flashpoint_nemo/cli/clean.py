"""`flashpoint clean BASE`: remove leftovers of unfinished saves and superseded versions, safely.

- Never touches the newest committed version, nor uncommitted versions newer than it (a save
  may be writing them).
- Takes every rank's pool lock (non-blocking) and holds them while it removes files, so no
  saver of this base can start meanwhile; a lock held by a live process means a job is using
  the base: clean refuses (exit 3) unless --force, and then leaves temp files alone.
- A committed version is retired as the savers retire it: its COMMIT goes first, so it is
  never seen half-deleted.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ml_flashpoint_nemo.cli.common import (
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    PoolLocks,
    human_bytes,
    open_base,
    print_json,
)
from ml_flashpoint_nemo.cli.ls import allocated_bytes, scan_versions
from ml_flashpoint_nemo.core.layout import version_dir_name
from ml_flashpoint_nemo.core.trees import tree_bytes
from ml_flashpoint_nemo.core.versions import retire_version, superseded_steps


def _dir_bytes(path: str | os.PathLike[str]) -> int:
    return tree_bytes(path, allocated_bytes)


def run(args: argparse.Namespace) -> int:
    layout = open_base(args.base)
    if args.keep < 1:
        raise CliError("--keep must be >= 1: the newest committed version is never removed")
    verb = "would remove" if args.dry_run else "removed"
    with PoolLocks(layout) as locks:
        if locks.busy and not args.force:
            holders = ", ".join(f"rank {r}" + (f" (pid {pid})" if pid else "") for r, pid in locks.busy)
            message = (f"refusing to clean {layout.base_dir}: a live process holds the buffer pool of {holders}; "
                       "a job is using this base. Stop it first, or pass --force to remove only what is safe "
                       "while it runs.")
            if args.json:
                print_json({"base": str(layout.base_dir), "refused": message, "busy_ranks": [r for r, _ in locks.busy]})
            raise CliError(message, EXIT_BUSY)
        versions = scan_versions(layout)
        committed = [v.step for v in versions if v.committed]
        newest = max(committed, default=None)
        superseded = set(superseded_steps([v.step for v in versions], committed, keep=args.keep))  # as savers decide
        actions: list[dict[str, Any]] = []
        kept: list[dict[str, Any]] = []
        for v in versions:
            if v.step in superseded:
                reason = (f"committed, superseded: keeping the newest {args.keep}" if v.committed else
                          "uncommitted leftover of an unfinished save")
                actions.append({"step": v.step, "path": str(v.path), "what": "version", "reason": reason})
            elif not v.committed:
                kept.append({"step": v.step, "reason": "uncommitted and newer than every committed version: "
                                                       "a save may be writing it" if newest is not None else
                             "uncommitted, and no version is committed: a save may be writing it"})
            elif v.temp_files and not locks.busy:
                for name in v.temp_files:
                    actions.append({"step": v.step, "path": str(v.path / name), "what": "temp file",
                                    "reason": "stray temporary file of an interrupted write"})
        failures = []
        for action in actions:
            action["nbytes"] = _dir_bytes(action["path"]) if action["what"] == "version" else \
                _file_size(action["path"])
            if args.dry_run:
                continue
            try:
                if action["what"] == "version":
                    retire_version(layout, action["step"], rank=None)  # COMMIT first, then the objects
                else:
                    os.unlink(action["path"])
            except FileNotFoundError:
                pass
            except OSError as exc:
                action["error"] = str(exc)
                failures.append(action)
    if args.json:
        print_json({"base": str(layout.base_dir), "dry_run": args.dry_run, "keep": args.keep,
                    "newest_committed": newest, "removed" if not args.dry_run else "would_remove": actions,
                    "kept_uncommitted": kept, "forced_past_busy_ranks": [r for r, _ in locks.busy]})
    else:
        for a in actions:
            what = version_dir_name(a["step"]) if a["what"] == "version" else a["path"]
            status = f" FAILED: {a['error']}" if "error" in a else ""
            print(f"{verb} {what} ({a['reason']}, {human_bytes(a['nbytes'])}){status}")
        for k in kept:
            print(f"kept {version_dir_name(k['step'])} ({k['reason']})")
        if newest is not None:
            print(f"newest committed version: {version_dir_name(newest)} (never removed)")
        total = sum(a["nbytes"] for a in actions if "error" not in a)
        print(f"{verb} {len(actions) - len(failures)} item(s), {human_bytes(total)}" if actions else
              "nothing to remove")
        if locks.busy:
            print(f"warning: --force: ranks {[r for r, _ in locks.busy]} are in use by a live process; "
                  "temp files were left alone")
    return EXIT_FAILED if failures else EXIT_OK


def _file_size(path: str) -> int:
    try:
        return allocated_bytes(os.lstat(path))
    except OSError:
        return 0
