"""wrap_trainer_with_flashpoint on real NeMo trainers: the clear outcomes of each way to call it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ml_flashpoint_nemo.errors import BaseDirError
from ml_flashpoint_nemo.nemo.job import default_base_dir, job_id_from_environment
from tests.support.multiproc import REPO


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("wrap") / "base"
    done = subprocess.run([sys.executable, "-m", "tests.support.nemo_wrap_checks", str(base)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line and line.split()[0].isupper()]
    return {line.split()[0]: line.split(" ", 1)[1] for line in lines}


def test_a_fork_per_save_warns_on_pythons_whose_fork_can_deadlock(checks):
    """Only a fork per save (persistent_worker=False) on Python < 3.11.10 warns, naming the way out."""
    expected = 1 if sys.version_info < (3, 11, 10) else 0
    assert checks["FORK_WARNINGS"] == f"fork {expected} persistent 0 fork_can_deadlock {bool(expected)}", checks


def test_missing_job_id_says_what_to_set(checks):
    assert checks["NO_JOB_ID"].startswith("BaseDirError"), checks
    assert "FLASHPOINT_BASE_DIR" in checks["NO_JOB_ID"] and "FLASHPOINT_JOB_ID" in checks["NO_JOB_ID"]


def test_trainer_without_megatron_strategy_is_refused(checks):
    assert checks["WRONG_STRATEGY"].startswith("TrainerSetupError") and "MegatronStrategy" in checks["WRONG_STRATEGY"]


def test_bad_and_unknown_options_are_refused(checks):
    assert checks["BAD_OPTION"].startswith("TrainerSetupError") and "every_n_steps" in checks["BAD_OPTION"]
    assert checks["UNKNOWN_OPTION"].startswith("TrainerSetupError") and "evry_n_steps" in checks["UNKNOWN_OPTION"]


def test_wrapping_twice_changes_nothing_and_wraps_the_durable_io(checks):
    assert checks["TWICE"] == "same_callback True one_callback True io_wraps_durable True", checks


def test_overlap_capture_is_refused_with_writes_no_wait_can_guard(checks):
    ema, moe = checks["OVERLAP_REFUSED"].split(" | ")
    assert ema.startswith("TrainerSetupError") and "EMA callback" in ema, ema
    assert moe.startswith("TrainerSetupError") and "moe_router_enable_expert_bias" in moe, moe


def test_default_base_dir_comes_from_the_job_id(checks):
    assert checks["JOB_ID_BASE"] == "/dev/shm/ml_flashpoint/4242"


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"SLURM_JOB_ID": "123"}, "123"),
        ({"SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "80"}, "77_3"),
        ({"TORCHELASTIC_RUN_ID": "none"}, None),  # torchrun's default names nothing
        ({"TORCHELASTIC_RUN_ID": "abc-1"}, "abc-1"),
        ({"FLASHPOINT_JOB_ID": "../../etc", "SLURM_JOB_ID": "1"}, "etc"),  # made safe for a path
        ({}, None),
    ],
)
def test_job_id_from_environment(environ, expected):
    assert job_id_from_environment(environ) == expected


def test_explicit_base_dir_wins_and_no_id_is_an_error():
    assert str(default_base_dir({"FLASHPOINT_BASE_DIR": "/dev/shm/x", "SLURM_JOB_ID": "1"})) == "/dev/shm/x"
    with pytest.raises(BaseDirError, match="FLASHPOINT_JOB_ID"):
        default_base_dir({})


def test_recipe_plugin_adds_the_callback_config_and_wraps_the_resume(checks):
    assert checks["PLUGIN_CONFIG"] == "callbacks 1 resume FlashpointAutoResume durable True job_id exp-123", checks


def test_trainer_built_from_the_plugged_recipe_is_wired_at_setup(checks):
    assert checks["PLUGIN_TRAINER"] == "wired True every 7 auto_resume True", checks


def test_callback_saves_every_n_steps_skipping_durable_steps_unless_told_or_disabled(checks):
    # every 2 steps; ModelCheckpoint every 3: skip 6 and 12 / keep them / disabled
    assert checks["SHOULD_SAVE"] == "2,4,8,10 2,4,6,8,10,12 -", checks


def test_checkpoint_io_routes_by_marker_and_real_containment(checks):
    # a RAM version is retired by the flashpoint IO, a durable path by the wrapped IO; a marked save
    # outside the base dir and an unmarked (durable) save inside it are both refused
    assert checks["ROUTING"] == ("ram_removed True durable_removed True marked_outside BaseDirError "
                                 "unmarked_inside BaseDirError"), checks


def test_a_ram_save_skips_lightnings_barrier_unless_the_trainer_class_overrides_save_checkpoint(tmp_path):
    """save_without_barrier runs Lightning's dump_checkpoint and the strategy's save_checkpoint itself (no barrier),
    but a Trainer subclass that overrides save_checkpoint keeps its own."""
    from lightning.pytorch import LightningModule, Trainer

    from ml_flashpoint_nemo.nemo.callback import save_without_barrier

    saved: list[tuple[str, object]] = []

    class Recording(Trainer):
        def save_checkpoint(self, filepath, weights_only=False, storage_options=None):  # type: ignore[override]
            saved.append(("override", storage_options))

    for cls in (Trainer, Recording):
        trainer = cls(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
        trainer.strategy.connect(LightningModule())
        trainer.strategy.barrier = lambda *args, **kwargs: saved.append(("barrier", None))  # must not be reached
        trainer.strategy.save_checkpoint = lambda checkpoint, path, storage_options=None: saved.append(
            ("strategy", storage_options))
        save_without_barrier(trainer, tmp_path / "ckpt", {"marker": True})
    assert saved == [("strategy", {"marker": True}), ("override", {"marker": True})], saved
