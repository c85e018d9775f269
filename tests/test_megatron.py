"""megatron.core.dist_checkpointing with the flashpoint strategies, on real gloo process groups."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

from ml_flashpoint_nemo.core import committed_steps, verify_version
from ml_flashpoint_nemo.core.layout import CheckpointLayout
from ml_flashpoint_nemo.core.version_files import MEGATRON_CONFIG_BYTES, MEGATRON_CONFIG_NAME
from ml_flashpoint_nemo.errors import ChecksumError
from tests.support.multiproc import run_world
from tests.support.orphans import assert_helper_dies_with_parent
from tests.test_cli import flashpoint


def run(scenario: str, world_size: int, **params) -> list[str]:
    return run_world("megatron_scenarios", scenario, world_size,
                     {k: str(v) if hasattr(v, "__fspath__") else v for k, v in params.items()})


@pytest.mark.parametrize(
    "world_size, mode, fully_parallel",
    [
        (2, "sync", False),
        (4, "sync", True),
        (2, "temporal", False),  # AsyncCallsQueue with a forked worker per save
        (2, "persistent", True),  # AsyncCallsQueue with a spawned persistent worker
    ],
)
def test_megatron_save_load_round_trip(base_dir, world_size, mode, fully_parallel):
    run("roundtrip", world_size, base=base_dir, mode=mode, fully_parallel=fully_parallel)
    assert committed_steps(CheckpointLayout(base_dir)) == [2, 3]
    assert verify_version(base_dir, 3).objects == world_size
    assert (base_dir / "step-3" / "metadata.json").is_file()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_megatron_checkpoint_of_only_common_state_loads_as_with_torch_dist(base_dir, tmp_path, mode):
    outputs = run("only_common_state_round_trips_as_with_torch_dist", 2, base=base_dir, durable=tmp_path / "durable",
                  mode=mode)
    assert all("EMPTY LOADED [1]" in out for out in outputs), outputs


@pytest.mark.parametrize("file, offset", [("rank-00001-0.fpo", 64 + 10),  # inside the first record
                                          # torch.load would return {"hteration": 1}: zip CRCs are not checked
                                          ("common.pt", "iteration")])
def test_megatron_corrupted_object_or_common_state_is_refused(base_dir, file, offset):
    outputs = run("save_then_corrupt_is_refused", 2, base=base_dir, file=file, offset=offset)
    assert all("REFUSED" in out for out in outputs), outputs


def test_truncated_metadata_json_of_a_committed_version_is_restored(base_dir):
    outputs = run("interrupted_config_rewrite_is_repaired", 2, base=base_dir)
    assert all("REPAIRED" in out and "RESTORED" in out for out in outputs), outputs
    # the CLI, which never imports Megatron, repairs it the same way
    config = base_dir / "step-1" / MEGATRON_CONFIG_NAME
    config.write_bytes(b"")
    result = flashpoint("verify", base_dir, 1)
    assert result.returncode == 0, result.stdout + result.stderr
    assert config.read_bytes() == MEGATRON_CONFIG_BYTES


def test_second_save_stages_into_a_buffer_warmed_after_the_first(base_dir):
    outputs = run("second_save_reuses_a_buffer_warmed_after_the_first", 2, base=base_dir)
    assert all("WARM BUFFER REUSED" in out for out in outputs), outputs


def test_failed_background_write_fails_every_rank_and_keeps_previous(base_dir):
    outputs = run("failed_background_write_fails_every_rank", 2, base=base_dir)
    assert all("SAVE FAILED" in out and "rank 1" in out for out in outputs), outputs
    assert committed_steps(CheckpointLayout(base_dir)) == [1]


def test_closing_the_nemo_io_commits_the_save_queued_behind_a_failed_one(base_dir):
    for output in run("close_commits_the_saves_after_a_failed_one", 2, base=base_dir):
        assert "OUTCOMES 1:failed 2:ok" in output, output
        assert "COMMITTED [2]" in output, output


def test_a_save_staged_on_no_rank_but_one_does_not_hold_up_the_persistent_worker(base_dir):
    """Megatron's persistent caller never completes a call without a function: the failed save waited out the
    worker timeout (60 s here) and took the completion of the save after it, which then failed as well."""
    outputs = run_world("megatron_scenarios", "staging_fails_on_one_rank_before_its_persistent_worker", 2,
                        {"base": str(base_dir)}, timeout=150)
    for output in outputs:
        assert "OUTCOMES 1:failed 2:ok" in output and "COMMITTED [2]" in output, output


def test_a_dead_persistent_worker_fails_its_save_everywhere_instead_of_hanging(base_dir):
    outputs = run_world("megatron_scenarios", "dead_persistent_worker_drops_its_saves_everywhere", 2,
                        {"base": str(base_dir)}, timeout=150)
    for output in outputs:
        assert "OUTCOMES 1:ok 2:failed 3:ok" in output, output
    assert committed_steps(CheckpointLayout(base_dir))[-2:] == [1, 3]  # step 2 never committed
    assert "rank 1: its persistent save worker" in outputs[0] and "exited with code -9" in outputs[0], outputs[0]


def test_a_due_save_is_deferred_while_the_previous_one_is_sealing_then_taken(base_dir):
    outputs = run_world("megatron_scenarios", "a_due_save_waits_while_one_is_sealing", 2, {"base": str(base_dir)},
                        timeout=150)
    for output in outputs:  # every rank decides alike (the count of saves in flight is the same everywhere)
        assert "DECISIONS 2:True 3:False 4:False 5:False 5:True DEFERRED 1" in output, output
        assert "OUTCOMES 2:ok" in output, output
    assert committed_steps(CheckpointLayout(base_dir)) == [2]


def test_overlapped_capture_makes_the_optimizer_step_wait_and_saves_the_state_before_it(base_dir):
    outputs = run_world("megatron_scenarios", "overlapped_capture_holds_the_optimizer_step", 2,
                        {"base": str(base_dir)}, timeout=150)
    for rank, output in enumerate(outputs):
        for step in (1, 2, 3, 4):
            # the save returned with its copy in flight (rank 1's 4th, without a channel, waited for it), and the
            # optimizer step began only once it was done
            after_save = 0 if (rank, step) == (1, 4) else 1
            assert f"STEP {step} in flight after the save {after_save}, at the optimizer step 0" in output, output
        assert "SAVE 2 FAILED: FlashpointError" in output and "background copy failed" in output, output
        for step in (1, 3, 4):
            assert f"STEP {step} EXACT True CHANGED True" in output, output
        assert "LOAD in flight after it 0, STEP 5 EXACT True CHANGED True" in output, output  # the load waited
    assert committed_steps(CheckpointLayout(base_dir)) == [4, 5]


def test_a_hung_worker_fails_its_save_everywhere_within_the_timeout(base_dir):
    outputs = run_world("megatron_scenarios", "hung_worker_fails_its_save_within_the_timeout", 2,
                        {"base": str(base_dir)}, timeout=150)
    for output in outputs:
        assert "OUTCOMES 1:ok 2:failed 3:ok" in output, output
        finalized_s = float(re.search(r"FINALIZED in ([\d.]+)s", output).group(1))
        assert finalized_s < 20, output
    assert all("worker_gone=True" in output for output in outputs), outputs
    # Every rank's own pending save ages alike (rank 0's is waiting on rank 1's to finalize), so which ranks
    # pass worker_timeout_s first at the shared check depends on scheduling; at least one does, and names itself.
    assert re.search(r"rank [01]: the background write of step 2 is not done after", outputs[0]), outputs[0]
    assert committed_steps(CheckpointLayout(base_dir))[-2:] == [1, 3]


@pytest.mark.parametrize("hook, timeout", [("fail", None), ("hang", 5)])
def test_manager_failure_on_one_rank_fails_the_first_save_on_every_rank(base_dir, hook, timeout):
    outputs = run("manager_failure_fails_first_save_everywhere", 2, base=base_dir, manager=hook,
                  manager_timeout=timeout)
    assert all("SAVE FAILED: ManagerStartError" in out and "rank 1" in out for out in outputs), outputs
    assert committed_steps(CheckpointLayout(base_dir)) == []


def test_cached_plan_is_dropped_when_one_rank_changes_structure(base_dir):
    outputs = run("plan_reused_only_while_structure_is_unchanged", 2, base=base_dir)
    assert all("SAVE 4 FAILED: FlashpointError" in out and "staging failed" in out for out in outputs), outputs


def test_a_plan_whose_recipes_keep_failing_stops_learning_them(base_dir):
    run("recipes_that_keep_failing_are_not_relearnt", 2, base=base_dir)


@pytest.mark.parametrize("mode", ["temporal", "persistent"])
def test_overlapping_async_saves_each_find_their_own_worker_report(base_dir, mode):
    run("overlapping_saves_each_get_their_report", 2, base=base_dir, mode=mode)
    assert committed_steps(CheckpointLayout(base_dir))[-1] == 3


def test_overlapping_saves_reuse_the_plan_and_report_compactly_after_a_full_report(base_dir):
    """Each save scheduled before the previous one finalized, the first failing on rank 1: the save queued behind it
    reports in full and commits, the later ones send rank 0 their object records alone; planning runs once."""
    outputs = run("overlapping_saves_report_compactly_after_a_full_one", 2, base=base_dir)
    assert all("SAVE 1 FAILED" in out and "rank 1" in out and "PLANS 1\n" in out for out in outputs), outputs
    assert "REPORTS full compact compact compact\n" in outputs[0], outputs[0]


def node_bases(tmp_path, nodes: int) -> list[str]:
    return [str(tmp_path / f"node-{n}") for n in range(nodes)]


@pytest.mark.parametrize("world_size, nodes", [(2, 2), (4, 2)])
def test_every_node_holds_the_common_state_and_commit(shm_dir, world_size, nodes):
    bases = node_bases(shm_dir, nodes)
    run("common_state_on_every_node", world_size, bases=bases, ranks_per_node=world_size // nodes)
    for node, base in enumerate(bases):
        version = CheckpointLayout(base).version_dir(2)
        assert {"COMMIT", "common.pt", "metadata.json", ".metadata"} <= set(os.listdir(version)), node
        node_ranks = range(node * world_size // nodes, (node + 1) * world_size // nodes)
        report = verify_version(base, 2, ranks=node_ranks)
        assert (report.objects, report.files) == (len(node_ranks), 3)
        assert committed_steps(CheckpointLayout(base)) == [1, 2]


@pytest.mark.parametrize("damage", [None, "deleted", "flipped"])
def test_node_leaders_receive_the_unchanged_metadata_once(shm_dir, damage):
    """DCP's `.metadata` (every chunk of the job) repeats while the structure does: a node leader gets it with
    the first save and copies it from its previous version afterwards. A leader whose previous copy is gone or
    damaged gets it sent again, and its node still holds a complete, loadable version."""
    bases = node_bases(shm_dir, 2)
    outputs = run("version_files_sent_once", 4, bases=bases, ranks_per_node=2, damage=damage)
    leader = [line for line in outputs[2].splitlines() if line.startswith("COPY")]
    first = "COPY 1 SENT .metadata,COMMIT,common.pt,metadata.json REUSED "
    reused = "SENT COMMIT,common.pt REUSED .metadata,metadata.json"
    resent = "COPY 3 SENT .metadata,COMMIT,common.pt,metadata.json REUSED "
    expected = [first, f"COPY 2 {reused}", f"COPY 3 {reused}"] + ([resent] if damage else [])
    assert leader == expected, outputs[2]
    assert not any(line.startswith("COPY") for out in outputs[:2] + outputs[3:] for line in out.splitlines())
    for node, base in enumerate(bases):
        report = verify_version(base, 3, ranks=range(2 * node, 2 * node + 2))
        assert (report.objects, report.files) == (2, 3), node


def test_node_that_cannot_take_the_version_fails_every_rank(shm_dir):
    bases = node_bases(shm_dir, 2)
    outputs = run("failed_node_copy_fails_every_rank", 2, bases=bases, ranks_per_node=1)
    assert all("SAVE FAILED: FlashpointError" in out and "not on every node" in out and "rank 1 (node 1)" in out
               for out in outputs), outputs
    assert committed_steps(CheckpointLayout(bases[0])) == [1, 2]
    assert committed_steps(CheckpointLayout(bases[1])) == [1]  # node 1 never shows a version it cannot load


def test_flipped_common_state_fails_the_load(base_dir):
    run("roundtrip", 2, base=base_dir, mode="sync", fully_parallel=False)
    common = base_dir / "step-3" / "common.pt"
    data = bytearray(common.read_bytes())
    data[len(data) // 2] ^= 0x40
    common.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="common.pt"):
        verify_version(base_dir, 3)


@pytest.mark.parametrize("started_by", ["megatron", "prestarted"])
def test_persistent_worker_dies_with_its_sigkilled_trainer(base_dir, started_by):
    """Megatron's persistent worker has no parent-death handling of its own: seal_and_report ties it to the
    trainer at its first save, and the IO's pre-started worker is tied before it boots. An NVRx in-job
    restart never finds the last incarnation's worker."""
    assert_helper_dies_with_parent(
        [sys.executable, "-m", "tests.support.persistent_worker_parent", str(base_dir), started_by],
        "WORKER PID ", f"persistent save worker ({started_by})")


def test_saves_fork_until_the_prestarted_persistent_worker_is_up_then_use_it(base_dir):
    outputs = run_world("megatron_scenarios", "saves_fork_until_the_persistent_worker_is_up", 2,
                        {"base": str(base_dir)}, timeout=180)
    for output in outputs:
        assert "CALLERS TemporalAsyncCaller LeanPersistentCaller LeanPersistentCaller" in output, output
        # its boot and its saves load our extension but neither torch nor Megatron (~3.5 s of CPU per rank)
        assert "WORKER LOADED TORCH False EXTENSION True" in output, output
        assert "OUTCOMES 1:ok 2:ok 3:ok" in output, output
        assert "WORKER GONE True EXIT [0]" in output, output  # it left on "DONE", not on a SIGKILL


def test_the_lean_caller_sends_nothing_to_a_stopped_worker_and_refuses_preloading_requests():
    """A call scheduled after its worker was stopped (an abort from another thread) is not queued (Megatron then
    reads it as done, and its save's finalize fails it on every rank); a request that preloads is refused."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    from ml_flashpoint_nemo.megatron.async_workers import LeanPersistentCaller, _nothing_left_to_close

    caller = LeanPersistentCaller()
    caller.close = _nothing_left_to_close  # Megatron's logs the process group's rank, which this test lacks
    try:
        caller.schedule_async_call(AsyncRequest(print, ("sealed",), [], call_idx=1))
        caller.queue.put("after")  # first out if nothing was queued before it
        assert caller.queue.get(timeout=30) == "after"
        with pytest.raises(TypeError, match="preload-free calls only"):
            caller.schedule_async_call(AsyncRequest(print, (), [], preload_fn=dict, call_idx=2))
    finally:
        for channel in (caller.queue, caller.preload_q, caller.comp_q):
            channel.close()


def test_closing_the_queue_of_a_worker_that_died_booting_returns():
    """Megatron's close would join the dead worker's queue forever (the campaign's Manager fault found it)."""
    from ml_flashpoint_nemo.megatron.async_workers import PersistentWorkerQueue

    queue = PersistentWorkerQueue()
    queue.start_worker()
    worker = queue.persistent_caller.process
    worker.kill()
    worker.join(10)
    started = time.monotonic()
    queue.close()
    assert time.monotonic() - started < 5
    assert queue.persistent_caller is None


def test_a_persistent_worker_dead_while_booting_leaves_saves_to_forked_workers(base_dir):
    outputs = run_world("megatron_scenarios", "worker_dead_while_booting_leaves_saves_to_forks", 2,
                        {"base": str(base_dir)}, timeout=180)
    assert all("OUTCOMES 1:ok 2:ok" in output for output in outputs), outputs
    assert "CALLERS LeanPersistentCaller LeanPersistentCaller" in outputs[0], outputs[0]
    assert "CALLERS TemporalAsyncCaller TemporalAsyncCaller" in outputs[1], outputs[1]
    assert "exited with code -9 while booting; every async save forks a worker of its own" in outputs[1], outputs[1]
