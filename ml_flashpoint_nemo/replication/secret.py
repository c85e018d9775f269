"""The job secret of the replication transfer service, agreed without sending it where possible.

The secret authenticates every transfer connection, so whoever reads it can push and fetch
checkpoint objects. Where it comes from, best first:

    FLASHPOINT_REPLICATION_SECRET_FILE   a file of hex digits readable only by the job's user
    FLASHPOINT_REPLICATION_SECRET        hex digits in the environment (FlashpointPlugin sets it)
    neither                              rank 0 draws one and broadcasts it through c10d, in clear
                                         on the training network (warned once, on rank 0)

A variable that is set but blank is an error, not "unset": a launcher that meant to pass a
secret and passed nothing must not silently fall back to the broadcast. A configured secret
must look random (see refuse_predictable_secret); new_secret_hex makes one.

Ranks check that they hold the same secret by all-gathering a keyed hash of it (HMAC-SHA256
of a fixed label), never the secret itself. Every decision is taken from the gathered values,
so every rank raises the same ReplicationSecretError or none does.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from typing import Any, Mapping

import torch.distributed as dist

from ml_flashpoint_nemo.errors import ReplicationSecretError

logger = logging.getLogger(__name__)

SECRET_ENV = "FLASHPOINT_REPLICATION_SECRET"
SECRET_FILE_ENV = "FLASHPOINT_REPLICATION_SECRET_FILE"
BROADCAST_SECRET_BYTES = 32
MIN_SECRET_BYTES = 16          # the transfer service refuses shorter secrets
MAX_SECRET_FILE_BYTES = 4096   # a secret file is a line of hex digits, not a data file
MAX_DISTINCT_BYTES_REQUIRED = 64  # a long random secret is not asked for more different byte values than this
_CHECK_LABEL = b"ml_flashpoint_nemo replication secret check v1"

_warned_broadcast = False


def new_secret_hex() -> str:
    """A fresh secret in the form the environment variable and the secret file take (64 hex digits)."""
    return os.urandom(BROADCAST_SECRET_BYTES).hex()


def secret_check(secret: bytes) -> bytes:
    """What ranks compare instead of the secret: a keyed hash that does not reveal it."""
    return hmac.new(secret, _CHECK_LABEL, hashlib.sha256).digest()


MAKE_ONE = ("make one with `python -c \"from ml_flashpoint_nemo.replication.secret import new_secret_hex; "
            "print(new_secret_hex())\"`")


def required_distinct_bytes(nbytes: int) -> int:
    """How many different byte values a secret of nbytes must hold: half its length, at most 64.

    Random bytes pass with room to spare (a random 16-byte secret fails with odds below 1e-12,
    a 32-byte one below 1e-16), while zeros, one repeated byte or a short repeated pattern fail.
    """
    return min(nbytes // 2, MAX_DISTINCT_BYTES_REQUIRED)


def refuse_predictable_secret(secret: bytes, where: str) -> None:
    """ReplicationSecretError when the secret is visibly not random; the message never shows it."""
    distinct, needed = len(set(secret)), required_distinct_bytes(len(secret))
    if distinct < needed:
        raise ReplicationSecretError(
            f"{where} is too predictable to be a replication secret: its {len(secret)} bytes hold only {distinct} "
            f"different byte value(s), and a secret needs at least half as many different values as it has "
            f"bytes (at most {MAX_DISTINCT_BYTES_REQUIRED}), so zeros, one repeated byte or a short repeated "
            f"pattern are refused; {MAKE_ONE}")


def _parse_hex(text: str, where: str) -> bytes:
    digits = "".join(text.split())
    if not digits:
        raise ReplicationSecretError(f"{where} is empty; write {2 * BROADCAST_SECRET_BYTES} hex digits into it: "
                                     f"{MAKE_ONE}")
    try:
        secret = bytes.fromhex(digits)
    except ValueError:
        raise ReplicationSecretError(
            f"{where} is not hexadecimal; write {2 * BROADCAST_SECRET_BYTES} hex digits into it: {MAKE_ONE}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ReplicationSecretError(
            f"{where} holds {len(secret)} bytes; the replication secret needs at least {MIN_SECRET_BYTES} "
            f"random bytes ({2 * MIN_SECRET_BYTES} hex digits, {2 * BROADCAST_SECRET_BYTES} recommended): {MAKE_ONE}")
    refuse_predictable_secret(secret, where)
    return secret


def read_secret_file(path: str) -> bytes:
    """The secret in path; refused unless it is a regular file of this user that nobody else may read."""
    where = f"the replication secret file {path!r} ({SECRET_FILE_ENV})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        raise ReplicationSecretError(f"cannot open {where}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # of what was opened, so a file swapped in meanwhile is what gets checked
        if not stat.S_ISREG(info.st_mode):
            raise ReplicationSecretError(f"{where} is not a regular file")
        if info.st_uid != os.geteuid():
            raise ReplicationSecretError(
                f"{where} belongs to uid {info.st_uid}, not to this job's user (uid {os.geteuid()}); "
                "give the job its own copy")
        if info.st_mode & 0o077:
            raise ReplicationSecretError(
                f"{where} may be read or written by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"run `chmod 600 {path}`")
        if info.st_size > MAX_SECRET_FILE_BYTES:
            raise ReplicationSecretError(f"{where} has {info.st_size} bytes; a secret file holds one line of hex")
        raw = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ReplicationSecretError(f"{where} is not hexadecimal text") from None
    return _parse_hex(text, where)


def _refuse_blank(env: Mapping[str, str], name: str) -> None:
    """A variable that is set but holds only whitespace: an error, so that it never reads as unset."""
    if name in env and not env[name].strip():
        raise ReplicationSecretError(
            f"{name} is set but empty; give it a value ({MAKE_ONE}), or unset it (`unset {name}`) to have "
            "rank 0 broadcast a secret in clear")


def configured_secret(environ: Mapping[str, str] | None = None) -> tuple[bytes, str] | None:
    """(secret, where it came from) from the environment or the secret file; None when neither is set."""
    env = os.environ if environ is None else environ
    _refuse_blank(env, SECRET_ENV)
    _refuse_blank(env, SECRET_FILE_ENV)
    if SECRET_ENV in env and SECRET_FILE_ENV in env:
        raise ReplicationSecretError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set; set only one")
    if SECRET_FILE_ENV in env:
        return read_secret_file(env[SECRET_FILE_ENV].strip()), SECRET_FILE_ENV
    if SECRET_ENV in env:
        return _parse_hex(env[SECRET_ENV], SECRET_ENV), SECRET_ENV
    return None


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def agree_on_secret() -> bytes:
    """Collective: the job secret, the same on every rank; it crosses the network only as the fallback.

    One all_gather_object of (problem, source, keyed hash) on every path; one broadcast more,
    on every rank alike, only when no rank has a configured secret.
    """
    rank = dist.get_rank()
    secret: bytes | None = None
    source: str | None = None
    problem: str | None = None
    try:
        found = configured_secret()
        if found is not None:
            secret, source = found
    except Exception as exc:  # noqa: BLE001 - every rank learns it through the gather below
        problem = f"rank {rank}: {exc}"
    mine = (problem, source, None if secret is None else secret_check(secret))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    problems = [g[0] for g in gathered if g[0]]
    if problems:
        raise ReplicationSecretError("the replication secret cannot be used: " + "; ".join(problems))
    unset = [r for r, g in enumerate(gathered) if g[1] is None]
    if len(unset) == len(gathered):
        return _broadcast_secret(rank)
    if unset:
        raise ReplicationSecretError(
            f"ranks {_ranks(unset)} have no replication secret while the others have one; set {SECRET_FILE_ENV} "
            f"or {SECRET_ENV} for every rank of the job (the launcher's or executor's environment)")
    groups: dict[bytes, list[int]] = {}
    for r, g in enumerate(gathered):
        groups.setdefault(g[2], []).append(r)
    if len(groups) > 1:
        listing = "; ".join(f"ranks {_ranks(members)}" for members in groups.values())
        raise ReplicationSecretError(
            f"the ranks hold different replication secrets ({listing} agree among themselves); give every rank "
            f"of the job the same {SECRET_FILE_ENV} contents or {SECRET_ENV}")
    assert secret is not None
    return secret


def _broadcast_secret(rank: int) -> bytes:
    global _warned_broadcast
    if rank == 0 and not _warned_broadcast:
        _warned_broadcast = True
        logger.warning(
            "The replication secret is sent to every rank through torch.distributed, in clear on the training "
            "network, because neither %s nor %s is set. Anyone who can read that network can then push and "
            "fetch RAM checkpoint objects; on a shared cluster set one of them (see docs/security.md).",
            SECRET_FILE_ENV, SECRET_ENV)
    box: list[Any] = [None]
    if rank == 0:
        try:  # never raises on rank 0 alone: the others wait in the broadcast
            box[0] = os.urandom(BROADCAST_SECRET_BYTES)
        except Exception as exc:  # noqa: BLE001 - sent instead of the secret, raised on every rank below
            box[0] = f"rank 0 could not draw a replication secret ({type(exc).__name__}: {exc})"
    dist.broadcast_object_list(box, src=0)
    secret = box[0]
    if isinstance(secret, str):
        raise ReplicationSecretError(f"{secret[:500]}; set {SECRET_FILE_ENV} or {SECRET_ENV} for every rank")
    if not isinstance(secret, bytes) or len(secret) != BROADCAST_SECRET_BYTES:
        # Cannot differ between ranks (all got rank 0's object), so every rank raises alike.
        raise ReplicationSecretError("the broadcast replication secret is malformed")
    return secret
