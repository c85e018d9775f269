"""The `flashpoint` console script: inspect, verify, export and clean RAM checkpoints.

    flashpoint ls BASE [--json]
    flashpoint verify BASE [STEP] [--json] [--threads N]
    flashpoint export BASE STEP DEST [--force] [--progress] [--threads N]
    flashpoint clean BASE [--keep K] [--dry-run] [--force] [--json]

Also runs as `python -m ml_flashpoint_nemo.cli`. Exit codes: see EXIT_CODES_HELP.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Sequence

from ml_flashpoint_nemo.cli.common import EXIT_CODES_HELP, EXIT_CORRUPT, EXIT_FAILED, EXIT_FORMAT, EXIT_USAGE, CliError

__all__ = ["build_parser", "main"]

_DESCRIPTION = "Inspect, verify, export and clean ml_flashpoint_nemo RAM checkpoints (format v1)."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashpoint", description=_DESCRIPTION, epilog=EXIT_CODES_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    ls = _add_command(
        commands, "ls", help="list every version (committed or not) and the buffer pools",
        description="List every version under BASE: step, state (committed / unreadable commit record / "
                    "uncommitted), kind (dcp or core), world size, ranks, objects, bytes, creation time, "
                    "replication state (unknown until versions record it); then each rank's pool of free "
                    "buffers and whether a live process holds it, and the replica spares (files of retired "
                    "replicas whose memory the next received replica reuses; never checkpoint data).")
    ls.add_argument("base", metavar="BASE", help="the job's base directory (e.g. /dev/shm/<job>)")
    ls.add_argument("--json", action="store_true", help="print one JSON document")

    verify = _add_command(
        commands, "verify", help="check every byte of committed versions against their checksums",
        description="Verify STEP, or every committed version: the commit record, version-level files and every "
                    "record of every object, against their CRC32C. Uncommitted versions are skipped.")
    verify.add_argument("base", metavar="BASE")
    verify.add_argument("step", metavar="STEP", nargs="?", help="the step to verify (default: every committed one)")
    verify.add_argument("--json", action="store_true", help="print one JSON document with a result per version")
    verify.add_argument("--threads", type=int, metavar="N", help="checksum threads (default: automatic)")

    export = _add_command(
        commands, "export", help="write a version as a standard torch DCP checkpoint directory",
        description="Write version STEP to DEST as a torch.distributed.checkpoint directory that "
                    "dcp.load(sd, storage_reader=FileSystemReader(DEST)) reads, bit-exact. Every byte is verified "
                    "on the way; on any failure no DEST is left behind (it is written as DEST.tmp-* and renamed).\n\n"
                    "DCP-kind versions keep their keys, global shapes and chunks (sharding offsets); bytes items "
                    "are copied verbatim. Core-kind versions (CheckpointSaver): one rank's state keeps its plain "
                    "keys, several ranks' keys become 'rank{R}/{key}'; bytes records load as Python bytes.")
    export.add_argument("base", metavar="BASE")
    export.add_argument("step", metavar="STEP")
    export.add_argument("dest", metavar="DEST", help="directory to create (must not exist or be empty)")
    export.add_argument("--force", action="store_true", help="replace a non-empty DEST")
    export.add_argument("--progress", action="store_true", help="show a progress bar even if stderr is not a TTY")
    export.add_argument("--threads", type=int, metavar="N", help="read threads (default: automatic)")

    clean = _add_command(
        commands, "clean", help="remove leftovers and superseded versions",
        description="Remove uncommitted leftovers older than the newest committed version, stray temporary "
                    "files, and committed versions beyond the newest K. The newest committed version and "
                    "uncommitted versions newer than it are never touched. Refuses (exit 3) while a live "
                    "process holds a rank's pool lock, unless --force. While it runs, clean holds every rank's "
                    "pool lock itself, so a job starting on BASE meanwhile is refused (PoolBusyError) instead of "
                    "racing the removal. Like free pool buffers, replica spares (pool/replica-spares) are kept "
                    "for the job's next run; remove BASE to free all of its memory.")
    clean.add_argument("base", metavar="BASE")
    clean.add_argument("--keep", type=int, default=1, metavar="K", help="committed versions to keep (default 1)")
    clean.add_argument("--dry-run", action="store_true", help="print what would be removed; change nothing")
    clean.add_argument("--force", action="store_true", help="clean even while a live process holds a pool lock")
    clean.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def _add_command(commands: Any, name: str, *, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand whose description keeps its line breaks and whose help ends with the exit codes, as the
    top level's does."""
    return commands.add_parser(name, help=help, description=description, epilog=EXIT_CODES_HELP,
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on usage errors, like every other usage error here
    from ml_flashpoint_nemo.errors import (
        CorruptCheckpointError,
        FlashpointError,
        FormatVersionError,
        VersionNotFoundError,
    )

    if args.command == "ls":
        from ml_flashpoint_nemo.cli.ls import run
    elif args.command == "verify":
        from ml_flashpoint_nemo.cli.verify import run
    elif args.command == "export":
        from ml_flashpoint_nemo.cli.export import run
    else:
        from ml_flashpoint_nemo.cli.clean import run
    try:
        return run(args)
    except CliError as exc:
        _error(str(exc))
        return exc.code
    except CorruptCheckpointError as exc:
        _error(f"corrupt checkpoint: {exc}")
        return EXIT_CORRUPT
    except FormatVersionError as exc:
        _error(f"unsupported checkpoint format (not corrupt): {exc}")
        return EXIT_FORMAT
    except VersionNotFoundError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except (FlashpointError, OSError) as exc:
        _error(f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        return EXIT_FAILED


def _error(message: str) -> None:
    print(f"flashpoint: error: {message}", file=sys.stderr)
