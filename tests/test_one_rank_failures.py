"""Between two collectives no rank fails alone (issue 13, section 3): real 2-process gloo jobs.

A local failure injected on one rank must reach every rank (or be absorbed on every rank
alike) within the deadline; a rank left waiting in a collective fails the test by timeout.
"""

from __future__ import annotations

import pytest

from tests.support.multiproc import run_world

DEADLINE_S = 60


@pytest.mark.parametrize("failure", ["peer_name", "listing"])
def test_keep_for_next_save_proceeds_on_every_rank_after_a_local_failure(shm_dir, failure):
    outputs = run_world("collective_scenarios", "keep_after_a_local_failure", 2,
                        {"root": str(shm_dir), "failure": failure}, timeout=DEADLINE_S)
    # Nothing is committed, so nothing waits for replication: keep stays 1, except on the rank that could not tell.
    expected = ["KEEP 1", "KEEP 2" if failure == "listing" else "KEEP 1"]
    assert [e in out for e, out in zip(expected, outputs)] == [True, True], outputs
    if failure == "peer_name":
        assert "\\xff\\x0aforged" in outputs[0] and "\nforged" not in outputs[0], outputs[0]


@pytest.mark.parametrize("scenario", ["choose_after_a_listing_failure", "choose_after_an_inventory_failure"],
                         ids=["listing", "inventory"])
def test_choose_version_agrees_on_no_version_when_one_rank_cannot_list_its_versions(shm_dir, scenario):
    """Rank 1's listing of its committed versions fails (listing), or already its inventory of the base
    directory before the peer fetch (inventory): either way every rank chooses no version."""
    outputs = run_world("collective_scenarios", scenario, 2, {"root": str(shm_dir)}, timeout=DEADLINE_S)
    assert all("CHOSEN None" in out for out in outputs), outputs
    assert "cannot list its RAM checkpoint versions" in outputs[1], outputs[1]


def test_async_save_fails_on_every_rank_when_one_rank_cannot_make_its_writer(base_dir):
    outputs = run_world("megatron_scenarios", "writer_fails_on_one_rank", 2, {"base": str(base_dir)},
                        timeout=DEADLINE_S + 60)
    for out in outputs:
        assert "SAVE FAILED: FlashpointError" in out and "rank 1: BaseDirError" in out and "step-02" in out, out
        assert "previous version is intact" in out, out
    assert "COMMITTED [1, 3]" in outputs[0] or "COMMITTED [3]" in outputs[0], outputs[0]


def test_a_worker_that_cannot_be_inspected_on_one_rank_fails_its_save_everywhere(base_dir):
    outputs = run_world("megatron_scenarios", "uninspectable_worker_fails_its_save_everywhere", 2,
                        {"base": str(base_dir)}, timeout=DEADLINE_S + 90)
    for out in outputs:
        assert "OUTCOMES 1:ok 2:failed 3:ok" in out, out
    assert "rank 1: its save worker cannot be inspected (ValueError" in outputs[0], outputs[0]


def test_choose_version_skips_a_version_whose_check_fails_unexpectedly_on_one_rank(shm_dir):
    outputs = run_world("collective_scenarios", "choose_after_an_unexpected_check_failure", 2,
                        {"root": str(shm_dir)}, timeout=DEADLINE_S)
    assert all("CHOSEN None" in out for out in outputs), outputs
    assert "rank 1: ValueError: an unexpected failure in the version check" in outputs[0], outputs[0]


def test_problems_of_every_rank_gathers_messages_only_when_a_rank_has_one(shm_dir):
    """The usual case (no rank has a problem) costs one small all-reduce, no pickled gather."""
    outputs = run_world("collective_scenarios", "problems_reach_every_rank", 2, {"root": str(shm_dir)},
                        timeout=DEADLINE_S)
    for out in outputs:
        assert "NONE [] GATHERS 0" in out, out
        assert "ONE ['rank 1: disk full'] GATHERS 1" in out, out


def test_the_coordinator_alone_chooses_short_or_full_reports_and_a_bad_full_one_fails_every_rank(shm_dir):
    """Under a reused save plan rank 0 asks for full reports when it lacks the plan's items (megatron finalize)."""
    outputs = run_world("collective_scenarios", "short_or_full_reports", 2, {"root": str(shm_dir)}, timeout=DEADLINE_S)
    assert "NOBODY full=False gathered=[('short', 0), ('short', 1)] errors=[]" in outputs[0], outputs[0]
    assert "RANK0 full=True gathered=[['full', 0], ['full', 1]] errors=[]" in outputs[0], outputs[0]
    assert "NOBODY full=False gathered=None errors=[]" in outputs[1], outputs[1]
    assert "RANK0 full=True gathered=None errors=[]" in outputs[1], outputs[1]
    for out in outputs:
        assert "UNPICKLABLE full=True gathered=None errors=[\"rank 1: cannot pickle its report" in out, out
        assert "PROBLEM full=True gathered=None errors=['rank 1: disk full']" in out, out
