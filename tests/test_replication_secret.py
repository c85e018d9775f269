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

HEX = "2d1da0da2e3978f34083101bbddf4bce471ffbda8c84a142e17d17cb2998c413"  # drawn once by new_secret_hex
OTHER_HEX = "ccd16aacb22b342e3c023183c2696d9de3830c8bec5cc976220cc28c6b506fee"


@pytest.fixture(autouse=True)
def no_inherited_secret(monkeypatch):
    """Neither variable set in this process (nor in the ranks it starts, which inherit its environment)."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


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


@pytest.mark.parametrize("text,match", [("xyz" * 20, "not hexadecimal"), (HEX[:30], "at least 16"),
                                        ("", "is empty"), (" \n\t\n", "is empty")])
def test_bad_secret_text_is_refused(tmp_path, text, match):
    """In the secret file; in the variable too, unless blank (a blank variable has its own message, below)."""
    with pytest.raises(ReplicationSecretError, match=match):
        configured_secret({SECRET_FILE_ENV: str(secret_file(tmp_path, text))})
    if text.strip():
        with pytest.raises(ReplicationSecretError, match=match):
            configured_secret({SECRET_ENV: text})


def test_missing_file_directory_and_both_variables_are_refused(tmp_path):
    with pytest.raises(ReplicationSecretError, match="cannot open"):
        read_secret_file(str(tmp_path / "absent"))
    with pytest.raises(ReplicationSecretError, match="not a regular file"):
        read_secret_file(str(tmp_path))
    with pytest.raises(ReplicationSecretError, match="set only one"):
        configured_secret({SECRET_ENV: HEX, SECRET_FILE_ENV: str(secret_file(tmp_path, HEX))})


def test_the_check_is_keyed_and_does_not_contain_the_secret():
    secret = bytes.fromhex(HEX)
    assert secret_check(secret) != secret_check(bytes.fromhex(OTHER_HEX))
    assert secret not in secret_check(secret)


def agree(shm_dir: Path, envs: list[dict[str, str]]) -> list[str]:
    return run_world("collective_scenarios", "agree_on_secret", 2, {"root": str(shm_dir), "env": envs}, timeout=60)


def clear() -> dict[str, str]:
    """No secret variable for a rank: the autouse fixture removed both from the environment ranks inherit."""
    return {}


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


BAD_VALUES = {"one_blank": {SECRET_ENV: "  "}, "one_blank_file_variable": {SECRET_FILE_ENV: ""},
              "one_predictable": {SECRET_ENV: "00" * 32}}


@pytest.mark.parametrize("case", ["different", "one_unset", "one_unsafe_file", *BAD_VALUES])
def test_every_rank_raises_when_the_secrets_disagree_or_one_is_bad(shm_dir, tmp_path, case):
    """Two gloo ranks; rank 1's secret differs or is bad: both raise the same error and leave no collective."""
    bad = secret_file(tmp_path, HEX, 0o644)
    second = {"different": {SECRET_ENV: OTHER_HEX}, "one_unset": {},
              "one_unsafe_file": {SECRET_FILE_ENV: str(bad)}, **BAD_VALUES}[case]
    outputs = agree(shm_dir, [dict(clear(), **{SECRET_ENV: HEX}), dict(clear(), **second)])
    expected = {"different": "different replication secrets", "one_unset": "ranks 1 have no replication secret",
                "one_unsafe_file": "rank 1: the replication secret file",
                "one_blank": f"rank 1: {SECRET_ENV} is set but empty",
                "one_blank_file_variable": f"rank 1: {SECRET_FILE_ENV} is set but empty",
                "one_predictable": f"rank 1: {SECRET_ENV} is too predictable"}[case]
    for out in outputs:
        assert "RAISED ReplicationSecretError" in out and expected in out, outputs
        assert HEX not in out and OTHER_HEX not in out  # the secret is never printed


# --- predictable and blank secrets (finding 6c) ------------------------------------------------

PREDICTABLE = {
    "16 zero bytes": "00" * 16,
    "32 zero bytes": "00" * 32,
    "one repeated byte": "ab" * 32,
    "a 2-byte pattern": "a5c3" * 16,
    "a 4-byte pattern": "01020304" * 8,
    "an 8-byte pattern in 32 bytes": "0123456789abcdef" * 4,
    "15 values in 32 bytes": bytes(i % 15 for i in range(32)).hex(),
}


@pytest.mark.parametrize("text", PREDICTABLE.values(), ids=PREDICTABLE.keys())
def test_a_predictable_secret_is_refused_with_how_to_make_one(tmp_path, text):
    for environ in ({SECRET_ENV: text}, {SECRET_FILE_ENV: str(secret_file(tmp_path, text + "\n"))}):
        with pytest.raises(ReplicationSecretError, match="too predictable") as caught:
            configured_secret(environ)
        message = str(caught.value)
        assert "new_secret_hex" in message and "at least half as many different values" in message
        assert text not in message  # the (weak) secret is not printed either


def test_random_secrets_of_every_accepted_length_pass():
    assert configured_secret({SECRET_ENV: HEX[:32]}) == (bytes.fromhex(HEX[:32]), SECRET_ENV)  # 16 bytes
    for _ in range(200):
        text = new_secret_hex()
        assert configured_secret({SECRET_ENV: text}) == (bytes.fromhex(text), SECRET_ENV)
    long = bytes(range(256)).hex() * 4  # 1,024 bytes, every value: only 64 different values are asked for
    assert configured_secret({SECRET_ENV: long})[0] == bytes.fromhex(long)


@pytest.mark.parametrize("name", [SECRET_ENV, SECRET_FILE_ENV])
@pytest.mark.parametrize("value", ["", "   ", "\n\t"])
def test_a_variable_set_but_blank_is_an_error_not_unset(name, value):
    """A launcher that passed an empty value must not fall back to broadcasting a secret in clear."""
    with pytest.raises(ReplicationSecretError, match=f"{name} is set but empty") as caught:
        configured_secret({name: value})
    assert f"unset {name}" in str(caught.value) and "new_secret_hex" in str(caught.value)


def test_a_blank_variable_beside_a_good_one_is_refused(tmp_path):
    with pytest.raises(ReplicationSecretError, match=f"{SECRET_FILE_ENV} is set but empty"):
        configured_secret({SECRET_ENV: HEX, SECRET_FILE_ENV: ""})
    with pytest.raises(ReplicationSecretError, match=f"{SECRET_ENV} is set but empty"):
        configured_secret({SECRET_ENV: " ", SECRET_FILE_ENV: str(secret_file(tmp_path, HEX))})
