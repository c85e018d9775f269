"""One-rank failures at the collective sites of core/ and replication/ and of the callback (issue 13, section 3).

Run by tests/test_one_rank_sites.py on 2 gloo ranks, each rank its own "node" (base directory).
Each case injects a local failure on one rank; see tests/support/one_rank_sites.py.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from ml_flashpoint_nemo import _core
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.space import check_room_on_every_rank
from ml_flashpoint_nemo.core.topology import discover_nodes
from ml_flashpoint_nemo.errors import BaseDirError
from ml_flashpoint_nemo.nemo.callback import FlashpointCallback  # Lightning's import, before the timed cases
from ml_flashpoint_nemo.nemo.settings import FlashpointSettings
from ml_flashpoint_nemo.replication import choice, own_objects, recovery
from ml_flashpoint_nemo.replication.secret import SECRET_ENV, SECRET_FILE_ENV, agree_on_secret
from ml_flashpoint_nemo.replication.service import ReplicationConfig, ReplicationService, peer_endpoints
from tests.support.one_rank_sites import (
    Case,
    cases_main,
    committed_on_two_nodes,
    environment,
    failing_on,
    node_base,
)

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, force=True)

SECRET = "58715d4a1f6878f26cb0f20080911b81dc32c94442126ee5e81738e62c067938"
CONFIG = ReplicationConfig(io_timeout_s=2.0, connect_timeout_s=2.0, retries=0)


def discover_nodes_when_one_rank_has_no_identity(root: Path) -> str:
    """Rank 1 cannot even name its host: every rank raises BaseDirError from the one all_gather."""
    with failing_on(1, socket, "gethostname", OSError(errno.EIO, "Input/output error")):
        try:
            discover_nodes(node_base(root))
        except BaseDirError as exc:
            failure = f"RAISED {type(exc).__name__}: {exc}"
        else:
            failure = "RETURNED"
    return f"{failure} THEN {discover_nodes(node_base(root)).node_count} NODES"


def room_check_when_one_rank_cannot_stat(root: Path) -> str:
    """Rank 1's statvfs fails: the room check reports it, every rank raises OutOfSpaceError."""
    with failing_on(1, os, "statvfs", OSError(errno.EIO, "Input/output error")):
        check_room_on_every_rank(node_base(root))
    return "RETURNED"


def version_dir_in_the_way_on_one_rank(root: Path) -> str:
    """A file sits where rank 1's version directory goes: every rank raises BaseDirError; the file is kept."""
    base = node_base(root)
    base.mkdir(parents=True)
    if dist.get_rank() == 1:
        (base / "step-2").write_bytes(b"not a directory")
    try:
        check_room_on_every_rank(base, version_dir=base / "step-2")
    finally:
        if dist.get_rank() == 1:
            assert (base / "step-2").read_bytes() == b"not a directory"
    return "RETURNED"


def secret_broadcast_when_rank_0_cannot_draw(root: Path) -> str:
    """No configured secret, and rank 0's os.urandom fails: every rank raises ReplicationSecretError."""
    with environment(**{SECRET_ENV: None, SECRET_FILE_ENV: None}), \
            failing_on(0, os, "urandom", OSError(errno.ENOSYS, "Function not implemented")):
        agree_on_secret()
    return "AGREED"


def address_exchange_when_one_server_cannot_start(root: Path) -> str:
    """Rank 1's transfer server cannot start: every rank gets the addresses, rank 1's as None."""
    topology = discover_nodes(node_base(root))
    with environment(**{SECRET_ENV: SECRET}), \
            failing_on(1, _core, "TransferServer", OSError(errno.EADDRINUSE, "Address already in use")):
        endpoints = peer_endpoints(node_base(root), CONFIG, topology=topology)
    endpoints.close()
    return f"UNREACHABLE {[a is None for a in endpoints.addresses]}"


def replication_when_one_push_thread_cannot_start(root: Path) -> str:
    """Rank 1 cannot start its push thread: the service starts on every rank, keep_for_next_save gathers on
    every rank, and rank 1's versions are under-replicated."""
    base = node_base(root)
    base.mkdir(parents=True)
    topology = discover_nodes(base)
    with environment(**{SECRET_ENV: SECRET}), \
            failing_on(1, threading.Thread, "start", RuntimeError("can't start new thread")):
        service = ReplicationService.start(base, topology, CONFIG)
    try:
        keep = service.keep_for_next_save(1)
        service.replicate(7)
        state = service.replication_status(7).state if dist.get_rank() == 1 else "-"
        return f"KEEP {keep} RANK1 {state}"
    finally:
        service.close()


def replication_numbers_when_one_rank_cannot_tell(root: Path) -> str:
    """The callback's progress all_gather: rank 1's progress() fails, every rank reports the same numbers."""
    base = node_base(root)
    base.mkdir(parents=True)
    topology = discover_nodes(base)
    with environment(**{SECRET_ENV: SECRET}):
        service = ReplicationService.start(base, topology, CONFIG)
    try:
        callback = FlashpointCallback()
        callback.io = SimpleNamespace(flashpoint_strategy=SimpleNamespace(replication=service))
        with failing_on(1, service, "progress", RuntimeError("the replication state cannot be read")):
            numbers = callback._replication_numbers()
        return f"NUMBERS {sorted(numbers.items())}"
    finally:
        service.close()


def drain_start_when_one_rank_cannot_list_its_versions(root: Path) -> str:
    """The drain token broadcast at train start: rank 1's drain cannot start, every rank raises DurableDrainError."""
    rank = dist.get_rank()
    callback = FlashpointCallback()
    callback.settings = FlashpointSettings.create(node_base(root), durable_every_n_steps=1,
                                                  durable_dir=str(root / "durable"))
    callback.io = object()
    # Not rank 0's NeMo context staging (it needs a real trainer, and it never raises): is_global_zero False.
    trainer = SimpleNamespace(is_global_zero=False, global_rank=rank, world_size=dist.get_world_size(), global_step=0)
    try:
        with failing_on(1, CheckpointLayout, "version_steps", PermissionError(errno.EACCES, "Permission denied")):
            callback._start_drain(trainer)
        return f"STARTED {callback.drain is not None}"
    finally:
        callback._stop_drain()


def recovery_when_one_leader_cannot_fetch_the_version_files(root: Path) -> str:
    """Phase A: node 1 lacks the commit record and its leader's fetch fails: every rank gives the step up."""
    committed_on_two_nodes(root, without_commit=True)
    with environment(**{SECRET_ENV: SECRET}), \
            failing_on(1, recovery, "fetch_version_files", ConnectionError("injected: the peer vanished")):
        found = recovery.fetch_missing_from_peers(node_base(root), CONFIG)
    with environment(**{SECRET_ENV: SECRET}):
        return f"FETCHED {found} THEN {recovery.fetch_missing_from_peers(node_base(root), CONFIG)}"


def recovery_when_one_rank_cannot_fetch_an_object(root: Path) -> str:
    """Phase B: node 1 lacks rank 0's object and rank 1's fetch fails: every rank gives the step up."""
    committed_on_two_nodes(root, without_object_of=0)
    with environment(**{SECRET_ENV: SECRET}), \
            failing_on(1, recovery, "fetch_object_from", RuntimeError("injected: the fetch broke")):
        found = recovery.fetch_missing_from_peers(node_base(root), CONFIG)
    with environment(**{SECRET_ENV: SECRET}):
        return f"FETCHED {found} THEN {recovery.fetch_missing_from_peers(node_base(root), CONFIG)}"


def choice_when_dropping_corrupt_objects_fails_oddly(root: Path) -> str:
    """Checking rank 1's own object of step 1 fails with an error nobody expected: every rank still reaches
    the all-reduces of the choice and agrees that no version is usable (the next choice takes step 1)."""
    committed_on_two_nodes(root)
    with environment(**{SECRET_ENV: SECRET}), \
            failing_on(1, own_objects, "verify_object_file", ValueError("injected: an unexpected failure")):
        chosen = choice.choose_version(node_base(root))
    with environment(**{SECRET_ENV: SECRET}):
        return f"CHOSEN {chosen.step} THEN {choice.choose_version(node_base(root)).step}"


def choice_when_one_rank_base_dir_is_not_private(root: Path) -> str:
    """Rank 1's base directory is group-writable: every rank refuses to load (BaseDirError naming the chmod);
    once it is chmod 700 again, the choice takes step 1."""
    committed_on_two_nodes(root)
    if dist.get_rank() == 1:
        node_base(root).chmod(0o770)
    dist.barrier()
    with environment(**{SECRET_ENV: SECRET}):
        try:
            choice.choose_version(node_base(root))
        except BaseDirError as exc:
            failure = f"RAISED {type(exc).__name__}: {exc}"
        else:
            failure = "RETURNED"
        node_base(root).chmod(0o700)
        return f"{failure} THEN {choice.choose_version(node_base(root)).step}"


CASES: dict[str, Case] = {f.__name__: f for f in (
    discover_nodes_when_one_rank_has_no_identity,
    room_check_when_one_rank_cannot_stat,
    version_dir_in_the_way_on_one_rank,
    secret_broadcast_when_rank_0_cannot_draw,
    address_exchange_when_one_server_cannot_start,
    replication_when_one_push_thread_cannot_start,
    replication_numbers_when_one_rank_cannot_tell,
    drain_start_when_one_rank_cannot_list_its_versions,
    recovery_when_one_leader_cannot_fetch_the_version_files,
    recovery_when_one_rank_cannot_fetch_an_object,
    choice_when_dropping_corrupt_objects_fails_oddly,
    choice_when_one_rank_base_dir_is_not_private,
)}


if __name__ == "__main__":
    cases_main(CASES)
