"""The replication job secret: from a file or the environment, checked by a keyed hash, broadcast only as fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from ml_flashpoint_nemo.errors import ReplicationSecretError
from ml_flashpoint_nemo.replication.secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    configured_secret,
    new_secret_hex,
    read_secret_file,
    secret_check,
)
from tests.support.multiproc import run_world

HEX = "ab" * 32


def secret_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_secret_from_the_environment_or_a_private_file():
    assert configured_secret({}) is None
    assert configured_secret({SECRET_ENV: HEX}) == (bytes.fromhex(HEX), SECRET_ENV)
    assert len(bytes.fromhex(new_secret_hex())) == 32


def test_private_secret_file_is_read(tmp_path):
    path = secret_file(tmp_path, HEX + "\n")
    assert configured_secret({SECRET_FILE_ENV: str(path)}) == (bytes.fromhex(HEX), SECRET_FILE_ENV)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_a_secret_file_others_may_read_or_write_is_refused(tmp_path, mode):
    path = secret_file(tmp_path, HEX, mode)
    with pytest.raises(ReplicationSecretError, match="chmod 600"):
        read_secret_file(str(path))
    assert path.read_text() == HEX  # left as it was


@pytest.mark.parametrize("text,match", [("xyz" * 20, "not hexadecimal"), ("ab" * 8, "at least 16"),
                                        ("", "holds 0 bytes")])
def test_bad_secret_text_is_refused(tmp_path, text, match):
    with pytest.raises(ReplicationSecretError, match=match):
        configured_secret({SECRET_ENV: text} if text else {SECRET_FILE_ENV: str(secret_file(tmp_path, text))})


def test_missing_file_directory_and_both_variables_are_refused(tmp_path):
    with pytest.raises(ReplicationSecretError, match="cannot open"):
        read_secret_file(str(tmp_path / "absent"))
    with pytest.raises(ReplicationSecretError, match="not a regular file"):
        read_secret_file(str(tmp_path))
    with pytest.raises(ReplicationSecretError, match="set only one"):
        configured_secret({SECRET_ENV: HEX, SECRET_FILE_ENV: str(secret_file(tmp_path, HEX))})


def test_the_check_is_keyed_and_does_not_contain_the_secret():
    secret = bytes.fromhex(HEX)
    assert secret_check(secret) != secret_check(bytes.fromhex("cd" * 32))
    assert secret not in secret_check(secret)


def agree(shm_dir: Path, envs: list[dict[str, str]]) -> list[str]:
    return run_world("collective_scenarios", "agree_on_secret", 2, {"root": str(shm_dir), "env": envs}, timeout=60)


def clear() -> dict[str, str]:
    return {SECRET_ENV: "", SECRET_FILE_ENV: ""}


def test_every_rank_uses_the_configured_secret_and_nothing_is_broadcast(shm_dir, tmp_path):
    path = secret_file(tmp_path, HEX)
    outputs = agree(shm_dir, [dict(clear(), **{SECRET_ENV: HEX}), dict(clear(), **{SECRET_FILE_ENV: str(path)})])
    line = f"AGREED {secret_check(bytes.fromhex(HEX)).hex()} 32"
    assert all(line in out for out in outputs), outputs
    assert not any("sent to every rank" in out for out in outputs), outputs


def test_without_a_configured_secret_it_is_broadcast_with_one_warning_on_rank_0(shm_dir):
    outputs = agree(shm_dir, [clear(), clear()])
    agreed = [next(line for line in out.splitlines() if line.startswith("AGREED")) for out in outputs]
    assert agreed[0] == agreed[1], outputs
    assert outputs[0].count("sent to every rank through torch.distributed") == 1, outputs[0]
    assert "sent to every rank" not in outputs[1], outputs[1]


@pytest.mark.parametrize("case", ["different", "one_unset", "one_unsafe_file"])
def test_every_rank_raises_when_the_secrets_disagree_or_one_is_bad(shm_dir, tmp_path, case):
    bad = secret_file(tmp_path, HEX, 0o644)
    second = {"different": {SECRET_ENV: "cd" * 32}, "one_unset": {},
              "one_unsafe_file": {SECRET_FILE_ENV: str(bad)}}[case]
    outputs = agree(shm_dir, [dict(clear(), **{SECRET_ENV: HEX}), dict(clear(), **second)])
    expected = {"different": "different replication secrets", "one_unset": "ranks 1 have no replication secret",
                "one_unsafe_file": "rank 1: the replication secret file"}[case]
    for out in outputs:
        assert "RAISED ReplicationSecretError" in out and expected in out, outputs
        assert HEX not in out and "cd" * 32 not in out  # the secret is never printed
