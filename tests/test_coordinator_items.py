"""Rank 0's copy of every rank's items: compact reports under a reused plan rebuild the full write records.

The end-to-end paths (real ranks) are tests/test_bench_scale_smoke.py (bytes counted) and, for overlapping saves
and a save queued behind a failed one, tests/test_megatron.py; here the rules that keep a compact report from ever
being paired with the items of another plan.
"""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint.metadata import MetadataIndex

from ml_flashpoint_nemo.core.format import ObjectRecord
from ml_flashpoint_nemo.dcp.writer import write_results
from ml_flashpoint_nemo.errors import FlashpointError
from ml_flashpoint_nemo.megatron.coordinator_items import CoordinatorItems, compact_report


def full_report(rank: int, tensors: int, crc: int = 1) -> list:
    """What a rank sends under a new plan; rank 2 holds nothing."""
    if rank == 2:
        return []
    record = ObjectRecord(f"rank-{rank}.obj", rank, 4096 + rank, crc)
    keys = tuple(f"t{i}@{rank}" for i in range(tensors))
    indices = tuple(MetadataIndex(f"t{i}", (rank, 0)) for i in range(tensors))
    return write_results(record, (keys, indices))


def planned(items: CoordinatorItems, ranks: int = 3) -> list[list]:
    items.new_plan()
    gathered = [full_report(r, 5) for r in range(ranks)]
    assert items.full_results(gathered, compact=False, plan=items.plan) is gathered
    return gathered


def test_compact_reports_rebuild_the_full_write_records_of_the_plan():
    items = CoordinatorItems()
    assert not items.holds(items.plan)
    full = planned(items)
    assert items.holds(items.plan)
    # the next save: same items, new object records (its CRCs differ)
    fresh = [full_report(r, 5, crc=7) for r in range(3)]
    compact = [compact_report(results) for results in fresh]
    assert compact[2] is None and isinstance(compact[0], ObjectRecord)
    rebuilt = items.full_results(compact, compact=True, plan=items.plan)
    assert [[r.storage_data for r in per] for per in rebuilt] == [[r.storage_data for r in per] for per in fresh]
    assert [[r.index for r in per] for per in rebuilt] == [[r.index for r in per] for per in full]


def test_a_new_plan_has_no_items_until_its_full_report():
    items = CoordinatorItems()
    planned(items)
    items.new_plan()
    assert not items.holds(items.plan)
    with pytest.raises(FlashpointError, match="does not hold the items of save plan 2"):
        items.full_results([None, None, None], compact=True, plan=items.plan)


def test_a_save_under_the_older_plan_still_rebuilds_while_the_newer_plan_has_no_items():
    """Saves overlap: save N (plan 1) finalizes after save N+1 made plan 2; rank 0 still holds plan 1's items."""
    items = CoordinatorItems()
    full = planned(items)
    items.new_plan()
    assert items.holds(1) and not items.holds(2)
    rebuilt = items.full_results([compact_report(results) for results in full], compact=True, plan=1)
    assert [[r.index for r in per] for per in rebuilt] == [[r.index for r in per] for per in full]


def test_a_late_full_report_of_an_older_plan_is_not_kept():
    items = CoordinatorItems()
    items.new_plan()
    old = items.plan
    items.new_plan()  # the next save planned before the older one finalized
    items.full_results([full_report(r, 5) for r in range(3)], compact=False, plan=old)
    assert not items.holds(old) and not items.holds(items.plan)


@pytest.mark.parametrize("bad", ["record where none was", "none where a record was", "not a record"])
def test_a_compact_report_that_does_not_match_the_plan_fails_the_save_and_forgets_the_items(bad: str):
    items = CoordinatorItems()
    planned(items)
    compact = [compact_report(full_report(r, 5)) for r in range(3)]
    if bad == "record where none was":
        compact[2] = ObjectRecord("rank-2.obj", 2, 1, 1)
    elif bad == "none where a record was":
        compact[1] = None
    else:
        compact[0] = ("rank-0.obj", 0)
    with pytest.raises(FlashpointError, match="does not match the items"):
        items.full_results(compact, compact=True, plan=items.plan)
    assert not items.holds(items.plan)  # the next save under this plan reports in full


def test_a_compact_report_from_more_ranks_than_the_plan_had_fails():
    items = CoordinatorItems()
    planned(items)
    with pytest.raises(FlashpointError, match="does not hold the items"):
        items.full_results([None] * 4, compact=True, plan=items.plan)
    assert not items.holds(items.plan)
