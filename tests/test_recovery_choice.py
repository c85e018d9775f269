"""Which RAM version a restarted job resumes from: agreed by every rank, intact everywhere, else older."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.multiproc import run_world


def params(bases: list[str], world_size: int) -> dict:
    return {"bases": bases, "ranks_per_node": world_size // len(bases)}


def chosen(bases: list[str], world_size: int) -> set[str]:
    outputs = run_world("megatron_scenarios", "choose", world_size, params(bases, world_size))
    return {line for out in outputs for line in out.splitlines() if line.startswith("CHOSEN")}


def flip(path: Path, offset: int = 80) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10  # inside the first record
    path.write_bytes(bytes(data))


@pytest.fixture
def one_node(shm_dir) -> list[str]:
    bases = [str(shm_dir / "node")]
    run_world("megatron_scenarios", "common_state_on_every_node", 2, params(bases, 2))
    return bases


@pytest.fixture
def two_nodes(shm_dir) -> list[str]:
    """Two nodes of one rank each, saved steps 1 and 2 (replicated to each other in the background)."""
    bases = [str(shm_dir / "node-0"), str(shm_dir / "node-1")]
    run_world("megatron_scenarios", "common_state_on_every_node", 2, params(bases, 2))
    return bases


def exchange_objects(bases: list[str]) -> None:
    """What replication will do: every node also holds the other node's objects."""
    for source, target in ((bases[0], bases[1]), (bases[1], bases[0])):
        for step_dir in Path(source).glob("step-*"):
            for obj in step_dir.glob("rank-*.fpo"):
                if not (Path(target) / step_dir.name / obj.name).exists():
                    shutil.copy(obj, Path(target) / step_dir.name / obj.name)


def test_newest_version_is_chosen_when_intact_everywhere(one_node):
    assert chosen(one_node, 2) == {"CHOSEN 2"}


def test_flipped_byte_of_one_rank_makes_every_rank_take_the_older_version(one_node):
    flip(Path(one_node[0]) / "step-2" / "rank-00001-0.fpo")
    assert chosen(one_node, 2) == {"CHOSEN 1"}


@pytest.mark.parametrize("flip, expected", [
    # checked ahead (in the background at trainer set-up): the choice reads no object again
    (None, [["PASSED AHEAD True", "CHOSEN 2 READ 0"], ["PASSED AHEAD True", "CHOSEN 2 READ 0"]]),
    # rewritten after that check: the choice reads it again, finds the flip, every rank takes step 1
    ("after", [["PASSED AHEAD True", "CHOSEN 1 READ 1"], ["PASSED AHEAD True", "CHOSEN 1 READ 2"]]),
    # flipped before it: the check ahead does not pass, the choice finds the flip itself
    ("before", [["PASSED AHEAD True", "CHOSEN 1 READ 1"], ["PASSED AHEAD False", "CHOSEN 1 READ 2"]]),
])
def test_objects_checked_ahead_are_not_read_again_unless_rewritten(one_node, flip, expected):
    outputs = run_world("megatron_scenarios", "choose_after_verifying_ahead", 2, dict(params(one_node, 2), flip=flip))
    lines = [[line for line in out.splitlines() if line.startswith(("PASSED", "CHOSEN"))] for out in outputs]
    assert lines == expected, outputs


def test_flipped_common_state_makes_every_rank_take_the_older_version(one_node):
    flip(Path(one_node[0]) / "step-2" / "common.pt", offset=40)
    assert chosen(one_node, 2) == {"CHOSEN 1"}


def test_each_node_resumes_from_its_own_copy_of_the_version(two_nodes):
    exchange_objects(two_nodes)
    assert chosen(two_nodes, 2) == {"CHOSEN 2"}


def test_commit_record_missing_on_one_node_is_fetched_from_its_peer(two_nodes):
    exchange_objects(two_nodes)
    (Path(two_nodes[1]) / "step-2" / "COMMIT").unlink()
    assert chosen(two_nodes, 2) == {"CHOSEN 2"}
    assert (Path(two_nodes[1]) / "step-2" / "COMMIT").is_file()


def test_the_choice_copies_no_other_ranks_object(two_nodes):
    # node 1 lacks rank 0's object (which holds the replicated tensors): at the saved layout the choice checks
    # each rank's own objects and moves nothing else; a load that reads it fetches it (tests/test_replication.py)
    (Path(two_nodes[1]) / "step-2" / "rank-00000-0.fpo").unlink(missing_ok=True)
    assert chosen(two_nodes, 2) == {"CHOSEN 2"}
    assert not (Path(two_nodes[1]) / "step-2" / "rank-00000-0.fpo").exists()


def test_version_whose_only_copy_is_corrupt_is_skipped_everywhere(two_nodes):
    # rank 0's step-2 object is flipped on node 0 and in node 1's replica (when the save pushed one):
    # recovery drops the corrupt local copy, finds no good one on a peer and uses step 1
    for base in two_nodes:
        replica = Path(base) / "step-2" / "rank-00000-0.fpo"
        if replica.is_file():
            flip(replica)
    assert chosen(two_nodes, 2) == {"CHOSEN 1"}


@pytest.mark.parametrize("world_size", [1, 4])
def test_version_saved_by_another_world_size_is_chosen_when_every_object_is_there(one_node, world_size):
    """Elastic restart: the load strategies reshard, so the newest complete version is taken (it was refused)."""
    assert chosen(one_node, world_size) == {"CHOSEN 2"}


def test_at_another_world_size_the_objects_of_ranks_gone_are_checked_too(one_node):
    """A 1-rank restart reads old rank 1's object as well: a flipped byte there skips the version."""
    flip(Path(one_node[0]) / "step-2" / "rank-00001-0.fpo")
    assert chosen(one_node, 1) == {"CHOSEN 1"}


def test_node_left_alone_resumes_only_with_the_lost_nodes_objects(two_nodes):
    """Node 0 is lost for good and the job restarts on node 1 alone: with node 0's objects replicated
    there it resumes from RAM; without them no version is complete and the job falls back."""
    survivor = two_nodes[1:]
    for replica in Path(survivor[0]).glob("step-*/rank-00000-*.fpo"):  # what replication may have pushed
        replica.unlink()
    assert chosen(survivor, 1) == {"CHOSEN None"}
    exchange_objects(two_nodes)
    assert chosen(survivor, 1) == {"CHOSEN 2"}
