"""What each rank reports to rank 0 when a save finalizes, sized by one object rather than by its tensors.

A rank's write records name its object and, for each of its items, the record key and DCP index:
O(T) per rank, so rank 0 would receive O(N*T) every save (about 630 MB at 4,096 ranks and 2,000
tensors). Those items follow from the save plan alone. While the plan is reused (no rank's
structure changed, which every rank agrees on before the save), each rank sends only its object's
record (about 100 bytes) and rank 0 takes the items from the last full report made under the same
plan. Whether rank 0 holds them is settled at finalize, not when the save is scheduled: saves
overlap (the next one is scheduled before the previous one finalized, and may reuse its plan), and
the full report that would have brought the items may have failed. When rank 0 lacks them, every
rank of that save reports in full (megatron/strategies._finalize_save); the plan is kept.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from ml_flashpoint_nemo.core.format import ObjectRecord
from ml_flashpoint_nemo.dcp.writer import PlannedItems, write_results
from ml_flashpoint_nemo.errors import FlashpointError

__all__ = ["CoordinatorItems", "compact_report"]


def compact_report(results: list[WriteResult]) -> ObjectRecord | None:
    """This rank's report under a reused plan: its object's record, or None when it holds no item."""
    return results[0].storage_data[1] if results else None


class CoordinatorItems:
    """Rank 0's copy of every rank's items, tied to the plan they were reported under.

    plan counts the plans this strategy made (the same on every rank: ranks agree to reuse a plan);
    a save made under plan g sends compact reports only if rank 0 holds(g) at its finalize. Reports
    of an older plan that arrive late (an earlier save finalizing after the next one planned) are
    not kept.
    """

    def __init__(self) -> None:
        self.plan = 0
        self._kept: tuple[int, list[PlannedItems | None]] | None = None

    def new_plan(self) -> None:
        self.plan += 1

    def holds(self, plan: int) -> bool:
        """Whether rank 0 holds every rank's items under plan (always False on the other ranks)."""
        return self._kept is not None and self._kept[0] == plan

    def full_results(self, gathered: list[Any], *, compact: bool, plan: int) -> list[list[WriteResult]]:
        """Rank 0: every rank's write records, rebuilt from compact reports or kept from full ones."""
        if not compact:
            if plan == self.plan:
                self._kept = (plan, [_items_of(results) for results in gathered])
            return gathered
        if self._kept is None or self._kept[0] != plan or len(self._kept[1]) != len(gathered):
            self._kept = None
            raise FlashpointError(
                f"rank 0 does not hold the items of save plan {plan}, which this save's compact reports need; the "
                "next save reports in full. Report this: it is a bug in ml_flashpoint_nemo."
            )
        try:
            return [_rebuilt(rank, record, items) for rank, (record, items) in enumerate(zip(gathered, self._kept[1]))]
        except FlashpointError:
            self._kept = None
            raise


def _items_of(results: list[WriteResult]) -> PlannedItems | None:
    if not results:
        return None
    _, _, keys, indices = results[0].storage_data
    return keys, indices


def _rebuilt(rank: int, record: Any, items: PlannedItems | None) -> list[WriteResult]:
    if record is None and items is None:
        return []
    if not isinstance(record, ObjectRecord) or items is None:
        raise FlashpointError(
            f"rank {rank} reported {type(record).__name__} for its object under a reused save plan, which does "
            "not match the items it reported when the plan was made; the next save reports in full. Report this: "
            "it is a bug in ml_flashpoint_nemo."
        )
    return write_results(record, items)
