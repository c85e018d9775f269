"""Pretrain with a real NeMo 2.0 recipe on GPUs, with flashpoint RAM checkpoints and no code change.

    python examples/pretrain_gpt_flashpoint.py --gpus 8                # one node, torchrun
    python examples/pretrain_gpt_flashpoint.py --gpus 8 --dryrun       # print the configured task only

The recipe (Llama 3 8B pretraining; any NeMo 2.0 pretrain recipe works the same way) keeps
its durable ModelCheckpoint and AutoResume; FlashpointPlugin adds a FlashpointCallback config
to its trainer (RAM checkpoints every --every steps under /dev/shm, skipping steps where the
durable checkpoint saves) and wraps its resume in FlashpointAutoResume, so a restarted job
resumes from RAM when the RAM version is the newest complete one, else from the durable
checkpoint. Needs GPUs; on CPU see examples/quickstart.py.
"""

from __future__ import annotations

import argparse


def configure(args: argparse.Namespace):
    """The recipe, the executor and the plugin, as a user would write them."""
    import nemo_run as run
    from nemo.collections import llm

    from ml_flashpoint_nemo.nemo import FlashpointPlugin

    recipe = llm.llama3_8b.pretrain_recipe(name="flashpoint", dir=args.dir, num_nodes=1, num_gpus_per_node=args.gpus)
    recipe.trainer.max_steps = args.steps
    recipe.trainer.strategy.ckpt_async_save = True
    # A model small enough to try on one node; remove these lines for the real 8B.
    recipe.model.config.num_layers = args.layers
    executor = run.LocalExecutor(ntasks_per_node=args.gpus, launcher="torchrun")
    plugin = FlashpointPlugin(every_n_steps=args.every)
    return recipe, executor, plugin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="RAM checkpoint interval in steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", default="/tmp/flashpoint-pretrain", help="durable checkpoints and logs")
    parser.add_argument("--dryrun", action="store_true", help="configure and print, do not launch")
    args = parser.parse_args()

    import nemo_run as run

    recipe, executor, plugin = configure(args)
    run.run(recipe, executor=executor, plugins=[plugin], name="flashpoint-pretrain", dryrun=args.dryrun)


if __name__ == "__main__":
    main()
