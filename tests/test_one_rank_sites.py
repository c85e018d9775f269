"""Every collective site of the package, one rank failing locally next to it (issue 13, section 3).

Real 2-rank gloo worlds, each rank its own node. Every case injects a local failure on one
rank only (a monkeypatch in that rank's process, or a file in the way on its node) and
asserts that every rank ends the same way (the same error, or the same decision) within
CASE_BOUND_S. A world runs all its cases in sequence and meets in a barrier after each, so a
rank left waiting in a collective fails the whole world at its deadline instead of hanging.
The sites and what each test pins: docs/design.md, "Failures on one rank between collectives".
"""

from __future__ import annotations

import shutil
import uuid
from typing import Iterator

import pytest

from tests.conftest import SHM
from tests.support.multiproc import run_world
from tests.support.one_rank_sites import outcomes, seconds_of

CASE_BOUND_S = 60  # each case on this loaded machine takes a few seconds; a rank left waiting takes the gloo timeout
PLAIN_DEADLINE_S = 240
MEGATRON_DEADLINE_S = 420


def world(module: str, cases: list[str], timeout: float) -> Iterator[dict[str, list[str]]]:
    root = SHM / f"flashpoint-test-{uuid.uuid4().hex[:12]}"
    try:
        yield outcomes(run_world(module, "cases", 2, {"root": str(root), "cases": cases}, timeout=timeout))
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def plain() -> Iterator[dict[str, list[str]]]:
    from tests.support.one_rank_scenarios import CASES

    yield from world("one_rank_scenarios", list(CASES), PLAIN_DEADLINE_S)


@pytest.fixture(scope="module")
def megatron() -> Iterator[dict[str, list[str]]]:
    yield from world("one_rank_megatron_scenarios", MEGATRON_CASES, MEGATRON_DEADLINE_S)


MEGATRON_CASES = [
    "manager_start_when_one_rank_has_a_bad_timeout",
    "load_when_one_nodes_copy_is_damaged",
    "nemo_save_when_one_version_dir_cannot_be_made",
    "nemo_steady_saves_when_one_rank_cannot_start",
    "nemo_finalize_when_one_rank_cannot_count_the_bytes",
    "resume_when_one_rank_cannot_read_the_durable_checkpoint",
    "resume_when_the_ranks_see_different_durable_checkpoints",
    "resume_when_autoresume_failed_on_one_rank",
]


def every_rank(lines: list[str] | None, *expected: str) -> list[str]:
    """Both ranks' outcome lines, each containing every expected string, each within CASE_BOUND_S."""
    assert lines is not None and len(lines) == 2, lines
    for line in lines:
        assert all(e in line for e in expected), lines
        assert seconds_of(line) < CASE_BOUND_S, lines
    return lines


# --- core/ ----------------------------------------------------------------------------------------------------


def test_discover_nodes_raises_on_every_rank_when_one_rank_cannot_name_its_node(plain):
    every_rank(plain["discover_nodes_when_one_rank_has_no_identity"], "RAISED BaseDirError:",
               "rank 1 cannot resolve its base directory", "Input/output error", "THEN 2 NODES")


def test_room_check_fails_every_rank_when_one_rank_cannot_check(plain):
    every_rank(plain["room_check_when_one_rank_cannot_stat"], "RAISED OutOfSpaceError:", "skipped on every rank",
               "cannot check free space", "node-1")


def test_a_version_directory_one_rank_cannot_make_fails_every_rank(plain):
    every_rank(plain["version_dir_in_the_way_on_one_rank"], "RAISED BaseDirError:", "skipped on every rank",
               "cannot create the version directory", "node-1/step-2: FileExistsError")


# --- replication/ ---------------------------------------------------------------------------------------------


def test_secret_broadcast_fails_every_rank_when_rank_0_cannot_draw_it(plain):
    every_rank(plain["secret_broadcast_when_rank_0_cannot_draw"], "RAISED ReplicationSecretError:",
               "rank 0 could not draw a replication secret", "Function not implemented")


def test_address_exchange_lists_a_server_that_did_not_start_on_every_rank(plain):
    every_rank(plain["address_exchange_when_one_server_cannot_start"], "UNREACHABLE [False, True]")


def test_a_push_thread_that_cannot_start_leaves_every_rank_in_the_gathers(plain):
    lines = every_rank(plain["replication_when_one_push_thread_cannot_start"], "KEEP 1")
    assert "RANK1 under-replicated" in lines[1], lines


def test_recovery_gives_a_step_up_everywhere_when_one_leader_cannot_fetch_its_files(plain):
    every_rank(plain["recovery_when_one_leader_cannot_fetch_the_version_files"], "FETCHED None THEN 1")


def test_recovery_gives_a_step_up_everywhere_when_one_rank_cannot_fetch_an_object(plain):
    every_rank(plain["recovery_when_one_rank_cannot_fetch_an_object"], "FETCHED None THEN 1")


def test_choice_agrees_when_dropping_corrupt_objects_fails_oddly_on_one_rank(plain):
    every_rank(plain["choice_when_dropping_corrupt_objects_fails_oddly"], "CHOSEN None THEN 1")


def test_choice_refuses_on_every_rank_when_one_ranks_base_dir_is_not_private(plain):
    every_rank(plain["choice_when_one_rank_base_dir_is_not_private"], "RAISED BaseDirError:",
               "no RAM checkpoint is loaded on any rank", "node-1 is writable by group or others (mode 0770)",
               "chmod 700", "THEN 1")


# --- nemo/callback.py -----------------------------------------------------------------------------------------


def test_replication_numbers_are_the_same_on_every_rank_when_one_rank_cannot_tell(plain):
    every_rank(plain["replication_numbers_when_one_rank_cannot_tell"],
               "NUMBERS [('flashpoint/replicated_step', -1.0), ('flashpoint/under_replicated_ranks', 1.0)]")


def test_drain_start_fails_every_rank_when_one_rank_cannot_start_its_drain(plain):
    every_rank(plain["drain_start_when_one_rank_cannot_list_its_versions"], "RAISED DurableDrainError:",
               "cannot start on every rank", "rank 1: PermissionError")


# --- megatron/strategies.py -----------------------------------------------------------------------------------


def test_first_save_fails_every_rank_when_one_rank_cannot_start_its_manager(megatron):
    every_rank(megatron["manager_start_when_one_rank_has_a_bad_timeout"], "SAVE FAILED ManagerStartError:",
               "rank 1:", "FLASHPOINT_MANAGER_TIMEOUT_S", "THEN COMMITTED [2]")


def test_load_fails_every_rank_when_one_nodes_copy_is_damaged(megatron):
    every_rank(megatron["load_when_one_nodes_copy_is_damaged"], "LOAD FAILED CorruptCheckpointError:",
               "cannot be loaded: rank 1:", "THEN LOADED 2")


# --- nemo/checkpoint_io.py ------------------------------------------------------------------------------------


def test_nemo_save_is_skipped_everywhere_when_one_rank_cannot_make_its_version_dir(megatron):
    every_rank(megatron["nemo_save_when_one_version_dir_cannot_be_made"], "OUTCOMES 1:ok 2:failed 3:ok",
               "cannot create the version directory", "FileExistsError", "LOADED 3")


def test_nemo_steady_saves_fold_the_room_check_and_fail_every_rank_when_one_cannot_start(megatron):
    every_rank(megatron["nemo_steady_saves_when_one_rank_cannot_start"], "OUTCOMES 1:ok 2:failed 4:ok 5:ok",
               "cannot check free space", "COMMON.PT OF 2 False",
               "SAVE 3 FAILED FlashpointError:", "cannot start", "No space left", "COLLECTIVES ['all_reduce']",
               "LOADED 5")


def test_nemo_finalize_reports_the_save_everywhere_when_one_rank_cannot_count_its_bytes(megatron):
    lines = every_rank(megatron["nemo_finalize_when_one_rank_cannot_count_the_bytes"], "OUTCOMES 1:ok 2:ok",
                       "LOADED 2")
    assert "COUNTED [True, True]" in lines[0] and "COUNTED [False, True]" in lines[1], lines


# --- nemo/resume.py -------------------------------------------------------------------------------------------


def test_resume_takes_ram_everywhere_when_one_rank_cannot_read_the_durable_checkpoint(megatron):
    every_rank(megatron["resume_when_one_rank_cannot_read_the_durable_checkpoint"], "RESUMED FROM ram 1")


def test_resume_fails_everywhere_when_the_ranks_see_different_durable_checkpoints_and_no_ram(megatron):
    every_rank(megatron["resume_when_the_ranks_see_different_durable_checkpoints"], "RAISED FlashpointError:",
               "do not see the same durable checkpoint", "rank 0: step 7; rank 1: none")


def test_resume_fails_everywhere_when_autoresume_failed_on_one_rank_and_nothing_is_found(megatron):
    lines = every_rank(megatron["resume_when_autoresume_failed_on_one_rank"], "RAISED")
    assert "RAISED FlashpointError:" in lines[0] and "rank 1: ValueError: injected" in lines[0], lines
    assert "RAISED ValueError: injected" in lines[1], lines


def test_every_case_ran(plain, megatron):
    from tests.support.one_rank_scenarios import CASES

    assert sorted(plain) == sorted(CASES) and sorted(megatron) == sorted(MEGATRON_CASES), (plain, megatron)
