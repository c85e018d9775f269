"""Child process for crash tests: saves versions in a loop until it is killed.

Usage: python -m tests.support.save_loop BASE_DIR FIRST_STEP [LAST_STEP]
Prints "committed <step>" after each commit. States cycle through four seeds
(step % 4) so that the loop spends its time saving, not generating data.
"""

from __future__ import annotations

import sys

from ml_flashpoint_nemo.core import CheckpointSaver
from tests.support.states import make_state

SEEDS = 4


def state_for_step(step: int) -> dict:
    return make_state(step % SEEDS, large_tensors=4, large_numel=1 << 20, small_tensors=300)


def main() -> None:
    base_dir, first = sys.argv[1], int(sys.argv[2])
    last = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 62
    states = {seed: state_for_step(seed) for seed in range(SEEDS)}
    saver = CheckpointSaver(base_dir)
    for step in range(first, last + 1):
        saver.save(step, states[step % SEEDS], keep=1)
        print(f"committed {step}", flush=True)


if __name__ == "__main__":
    main()
