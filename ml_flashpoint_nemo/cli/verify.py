"""`flashpoint verify BASE [STEP]`: check every byte of committed versions against their checksums."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ml_flashpoint_nemo.cli.common import (
    EXIT_CORRUPT,
    EXIT_FAILED,
    EXIT_FORMAT,
    EXIT_OK,
    CliError,
    human_bytes,
    open_base,
    parse_step,
    print_json,
)
from ml_flashpoint_nemo.core.format import CommitRecord, ObjectRecord
from ml_flashpoint_nemo.core.layout import CheckpointLayout, not_private_problem
from ml_flashpoint_nemo.core.tuning import default_copy_threads
from ml_flashpoint_nemo.core.version_files import check_version_files
from ml_flashpoint_nemo.core.versions import committed_steps, read_commit
from ml_flashpoint_nemo.errors import CorruptCheckpointError, FlashpointError, FormatVersionError


def _problem(exc: BaseException, rank: int | None) -> dict[str, Any]:
    """One problem as verify reports it; kind says what it means: corrupt, unsupported format, or a failure."""
    kind = "corrupt" if isinstance(exc, CorruptCheckpointError) else \
        "format" if isinstance(exc, FormatVersionError) else "failure"
    return {
        "rank": rank,
        "kind": kind,
        "type": type(exc).__name__,
        "path": getattr(exc, "path", None),
        "key": getattr(exc, "key", None),
        "error": str(exc) or type(exc).__name__,
    }


def verify_step(layout: CheckpointLayout, step: int, threads: int | None) -> dict[str, Any]:
    """Verify one committed version: its commit record, version files, then every rank's objects.

    The commit record is read and the version files checked once; each object is then checked
    once, rank by rank, so the work grows with the number of objects (not objects times ranks)
    and every corrupt rank is reported, not only the first.
    """
    result: dict[str, Any] = {"step": step, "ok": False, "objects": 0, "records": 0, "nbytes": 0, "files": 0,
                              "problems": []}
    problems = result["problems"]
    try:
        commit = read_commit(layout, step)
        result["files"] = check_version_files(layout, commit)
    except (FlashpointError, OSError) as exc:  # commit record or a version-level file
        problems.append(_problem(exc, None))
        return result
    threads = threads or default_copy_threads()
    for rank, objects in objects_by_rank(commit).items():
        try:
            records, nbytes = verify_rank(layout, step, objects, threads)
        except (FlashpointError, OSError) as exc:
            problems.append(_problem(exc, rank))
            continue
        result["objects"] += len(objects)
        result["records"] += records
        result["nbytes"] += nbytes
    result["ok"] = not problems
    return result


def objects_by_rank(commit: CommitRecord) -> dict[int, list[ObjectRecord]]:
    """The commit record's objects grouped by rank, ranks in ascending order, in one pass."""
    groups: dict[int, list[ObjectRecord]] = {}
    for obj in commit.objects:
        groups.setdefault(obj.rank, []).append(obj)
    return dict(sorted(groups.items()))


def verify_rank(layout: CheckpointLayout, step: int, objects: list[ObjectRecord], threads: int) -> tuple[int, int]:
    """Check every byte of one rank's objects; (records, bytes); raises on the first problem."""
    from ml_flashpoint_nemo.core.loader import verify_object_file  # imports torch

    records = nbytes = 0
    for obj in objects:
        count, size = verify_object_file(layout.object_path(step, obj.name), obj, threads)
        records += count
        nbytes += size
    return records, nbytes


_VERDICTS = {"corrupt": "CORRUPT", "failure": "FAILED", "format": "UNSUPPORTED FORMAT (not corrupt)"}


def _verdict(problems: list[dict[str, Any]]) -> str:
    """The worst kind among problems: corruption first, then a failure, then an unsupported format."""
    return next(kind for kind in _VERDICTS if any(p["kind"] == kind for p in problems))


def run(args: argparse.Namespace) -> int:
    layout = open_base(args.base)
    unsafe = not_private_problem(layout.base_dir)
    if unsafe is not None:  # intact bytes prove nothing about who wrote them
        print(f"warning: {unsafe}", file=sys.stderr)
    all_steps = layout.version_steps()
    committed = committed_steps(layout)
    if args.step is not None:
        step = parse_step(args.step)
        if step not in committed:
            if step in all_steps:
                raise CliError(f"step {step} in {layout.base_dir} is not committed (no COMMIT: a save in progress "
                               "or the leftover of a crashed one); nothing to verify")
            raise CliError(f"no version of step {step} in {layout.base_dir}; committed steps: {committed}")
        steps = [step]
    else:
        if not committed:
            raise CliError(f"nothing to verify: no committed version in {layout.base_dir}")
        steps = committed
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be >= 1")
    skipped = [s for s in all_steps if s not in committed] if args.step is None else []
    results = [verify_step(layout, s, args.threads) for s in steps]
    every_problem = [p for r in results for p in r["problems"]]
    code = {"corrupt": EXIT_CORRUPT, "failure": EXIT_FAILED, "format": EXIT_FORMAT}[_verdict(every_problem)] \
        if every_problem else EXIT_OK
    if args.json:
        print_json({"base": str(layout.base_dir), "ok": code == EXIT_OK, "exit_code": code, "versions": results,
                    "skipped_uncommitted": skipped})
        return code
    for r in results:
        if r["ok"]:
            print(f"step {r['step']}: OK ({r['objects']} objects, {r['records']} records, "
                  f"{human_bytes(r['nbytes'])}, {r['files']} version files)")
            continue
        print(f"step {r['step']}: {_VERDICTS[_verdict(r['problems'])]}")
        for p in r["problems"]:
            where = f"rank {p['rank']}" if p["rank"] is not None else "version"
            detail = f" [key {p['key']!r}]" if p.get("key") else ""
            print(f"  {where}{detail}: {p['type']}: {p['error']}")
    for s in skipped:
        print(f"step {s}: skipped (uncommitted)")
    bad = [r["step"] for r in results if not r["ok"]]
    print(f"{len(results) - len(bad)} of {len(results)} version(s) intact" + (f"; bad: {bad}" if bad else ""))
    return code


