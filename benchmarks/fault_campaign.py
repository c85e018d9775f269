"""Fault campaign: inject random faults into real 2-rank training with flashpoint and check every recovery.

Each run starts benchmarks/fault_campaign_rank.py as 2 ranks (each its own "node": own base
directory on /dev/shm, replication factor 2) twice: incarnation 0 trains with one injected fault;
after it ends (a killed rank ends its peer at once, as an elastic launcher does) the driver may
damage what is left (flip a byte in an object, a commit record or a version file; wipe a node);
incarnation 1 recovers (RAM version agreed by every rank, peers' replicas fetched, else the
newest durable copy, else step 0) and trains to the end. A run is then:

- recovered_newest: resumed from the newest version committed (by the coordinator) when the fault hit;
- fell_back: resumed from an older RAM version, the durable copy or step 0 (each with its reason:
  the fault destroyed or never produced the newer data, or "unexplained");
- wrong_load: the state loaded differs from the one saved at that step (SHA-256 of every tensor,
  logged before each save), the ranks resumed from different steps, or the final state differs
  from an uninterrupted reference run (must be 0);
- hang: an incarnation ran past --timeout, counted from the moment both ranks had their process
  group up (must be 0);
- startup_timeout: a rank was still starting (importing, in the rendezvous) after --startup-timeout:
  the machine, not the product (must be 0 too, else the run judged nothing);
- error: the recovery incarnation failed, or a fault that kills nothing stopped training.

Faults are drawn round-robin over the kinds (so N >= number of kinds covers each) with random
rank, step and timing:

    python benchmarks/fault_campaign.py --runs 100 --json [--seed 1] [--timeout 120] [--worker fork]

Exit status 1 when any run was a wrong load, a hang or an error. ENOSPC runs mount a small tmpfs
and are skipped (counted as such) without the privilege to mount.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
from launch import StartupTimeoutError, launch_ranks  # noqa: E402

RANK_SCRIPT = str(HERE / "fault_campaign_rank.py")
STEPS = 10
NPROC = 2
KILL_POINTS = ("kill_stage", "kill_write", "kill_commit", "kill_node_copy", "kill_replicate")
KINDS = (*KILL_POINTS, "kill_peer", "kill_random", "flip_object", "flip_commit", "flip_version_file",
         "wipe_node", "enospc", "manager_fail")
DESTROYS_DATA = {"flip_object", "flip_commit", "flip_version_file", "wipe_node", "manager_fail"}
VERSION_FILES = (".metadata", "common.pt", "metadata.json")
STARTUP = "startup"  # Campaign.incarnation's code for a start-up past --startup-timeout
ENOSPC_TMPFS = "384m"  # both nodes: pools, 2-3 versions and replicas of 16 MiB per rank


def draw_fault(kind: str, rng: random.Random) -> dict[str, Any]:
    """The fault of one run: which rank, at which step, before or after the point."""
    fault: dict[str, Any] = {"kind": kind, "rank": rng.randrange(NPROC), "step": rng.randint(2, STEPS - 1),
                             "when": rng.choice(("before", "after"))}
    if kind == "kill_commit":
        fault["rank"] = 0  # the coordinator commits
    if kind == "kill_node_copy":
        fault["rank"] = 1  # node 1's leader writes its copy of the version files
    if kind == "kill_random":
        fault["delay_s"] = round(rng.uniform(0.2, 6.0), 2)
    if kind.startswith(("flip_", "wipe_")):
        fault["stop_after"] = fault["step"]
        fault["node"] = rng.randrange(NPROC)
    if kind == "enospc":  # at step 1 the pool cannot be created; later, saves reuse it and replication fails
        fault["step"] = rng.randint(1, STEPS - 5)
        fault["stop_after"] = rng.randint(fault["step"] + 3, STEPS - 1)
    return fault


def committed_steps(base: Path) -> set[int]:
    return {int(d.name[5:]) for d in base.glob("step-*") if (d / "COMMIT").is_file()}


def flip_byte(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    offset = rng.randrange(len(data))
    data[offset] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"flipped a bit at byte {offset} of {len(data)} in {path.parent.name}/{path.name}"


def damage(fault: dict[str, Any], bases: list[Path], rng: random.Random) -> str:
    """The post-crash part of a flip or wipe fault, on the newest version committed on the chosen node."""
    base = bases[fault["node"]]
    step = max(committed_steps(base), default=None)
    if fault["kind"] == "wipe_node":
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir()
        return f"wiped node {fault['node']}"
    if step is None:
        return "nothing committed to damage"
    version = base / f"step-{step}"
    if fault["kind"] == "flip_commit":
        return flip_byte(version / "COMMIT", rng)
    if fault["kind"] == "flip_version_file":
        present = [version / name for name in VERSION_FILES if (version / name).is_file()]
        return flip_byte(rng.choice(present), rng) if present else "no version file to flip"
    objects = sorted(version.glob("rank-*.fpo"))
    return flip_byte(rng.choice(objects), rng) if objects else "no object to flip"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ledger_digests(run_dir: Path, rank: int) -> dict[int, set[str]]:
    """Every digest each step had, over both incarnations (deterministic training: one per step)."""
    digests: dict[int, set[str]] = {}
    path = run_dir / f"ledger-rank{rank}.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            entry = json.loads(line)
        except ValueError:  # the line a SIGKILL cut short
            continue
        digests.setdefault(entry["step"], set()).add(entry["digest"])
    return digests


def ram_listing(root: Path, limit: int = 60) -> list[str]:
    """What the nodes hold, for diagnosing a bad run: path and size of each file."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return [f"{p.relative_to(root)} {p.stat().st_size}" for p in files[:limit]]


def mount_small_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={ENOSPC_TMPFS}", "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


def unmount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fault_fired(fault: dict[str, Any], run_dir: Path, code0: int) -> bool:
    """The faulted rank logged its fault (a kill at a random time may come after the training ended).

    Without this check, a fault that could not be armed (a renamed hook point) would crash the
    rank at start and pass for a run that "fell back because nothing was committed".
    """
    if fault["kind"] == "manager_fail" or (fault["kind"] == "kill_random" and code0 == 0):
        return True  # a Manager start failure is the rank's own error; nothing for the harness to print
    log = run_dir / "logs-inc0" / f"rank-{fault['rank']}.log"
    return log.is_file() and "FAULT:" in log.read_text(errors="replace")


def log_tails(run_dir: Path, lines: int = 60) -> dict[str, list[str]]:
    """The last lines of every rank log of the newest incarnation: a problem run explains itself in CI output."""
    logs = sorted(run_dir.glob("logs-inc*"))
    if not logs:
        return {}
    return {log.name: log.read_text(errors="replace").splitlines()[-lines:] for log in sorted(logs[-1].iterdir())}


class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.ram_root = Path(tempfile.mkdtemp(prefix="flashpoint-campaign-", dir=args.ram_dir))
        self.disk_root = Path(tempfile.mkdtemp(prefix="flashpoint-campaign-"))
        self.env = dict(os.environ, OMP_NUM_THREADS="1", FLASHPOINT_COPY_THREADS="1",
                        FLASHPOINT_MANAGER_TIMEOUT_S=str(args.manager_timeout))

    def incarnation(self, run_dir: Path, bases: list[Path], incarnation: int, fault: dict[str, Any] | None,
                    flashpoint: bool = True) -> tuple[int | str | None, float]:
        """Run both ranks once; returns (worst exit code, seconds), code None when it hung after start-up
        and STARTUP when a rank did not start within --startup-timeout."""
        params = {"bases": [str(b) for b in bases], "durable": str(run_dir / "durable"), "run_dir": str(run_dir),
                  "steps": STEPS, "incarnation": incarnation, "fault": fault, "flashpoint": flashpoint,
                  "worker": self.args.worker, "startup_delay_s": self.args.startup_delay.get(incarnation, {}) if flashpoint else {},
                  "stack_dump_after_s": max(1.0, self.args.timeout - 15)}
        started = time.monotonic()
        code: int | str | None
        try:
            code = launch_ranks(RANK_SCRIPT, [json.dumps(params)], nproc=NPROC, timeout=self.args.timeout,
                                env=self.env, log_dir=run_dir / f"logs-inc{incarnation}", stop_on_failure=True,
                                stack_signal=signal.SIGUSR1, startup_timeout=self.args.startup_timeout)
        except StartupTimeoutError:
            code = STARTUP
        except TimeoutError:
            code = None
        return code, time.monotonic() - started

    def reference(self) -> list[str]:
        """Final digests of an uninterrupted run without flashpoint."""
        run_dir = self.disk_root / "reference"
        run_dir.mkdir()
        code, _ = self.incarnation(run_dir, [self.ram_root / "unused"] * NPROC, 0, None, flashpoint=False)
        if code == STARTUP:
            sys.exit(f"the reference run did not start within {self.args.startup_timeout} s; see {run_dir}/logs-inc0")
        finals = [read_json(run_dir / f"final-rank{r}-inc0.json") for r in range(NPROC)]
        if code != 0 or None in finals:
            sys.exit(f"the reference run failed (exit {code}); see {run_dir}/logs-inc0")
        return [f["final_digest"] for f in finals]  # type: ignore[index]

    def run(self, index: int, kind: str, reference: list[str]) -> dict[str, Any]:
        fault = draw_fault(kind, self.rng)
        run_dir = self.disk_root / f"run-{index:04d}"
        run_dir.mkdir()
        ram = self.ram_root / f"run-{index:04d}"
        mounted = kind == "enospc" and mount_small_tmpfs(ram)
        if kind == "enospc" and not mounted:
            return {"run": index, "fault": fault, "outcome": "skipped", "why": "cannot mount a small tmpfs (root)"}
        bases = [ram / f"node{n}" for n in range(NPROC)]
        for base in bases:
            base.mkdir(parents=True)
        try:
            record = self._judge(index, fault, run_dir, bases, reference)
            if record["outcome"] in ("wrong_load", "hang", "error", "startup_timeout"):
                record["ram_files"] = ram_listing(ram)
                record["log_tails"] = log_tails(run_dir)
            return record
        finally:
            if mounted:
                unmount(ram)
            if not self.args.keep:
                shutil.rmtree(ram, ignore_errors=True)

    def _judge(self, index: int, fault: dict[str, Any], run_dir: Path, bases: list[Path],
               reference: list[str]) -> dict[str, Any]:
        record: dict[str, Any] = {"run": index, "fault": fault}
        code0, seconds0 = self.incarnation(run_dir, bases, 0, fault)
        record["incarnation0"] = {"exit": code0, "seconds": round(seconds0, 2)}
        if code0 == STARTUP:
            return dict(record, outcome="startup_timeout", why=self._slow_start("incarnation 0"))
        if code0 is None:
            return dict(record, outcome="hang", why=f"incarnation 0 ran past {self.args.timeout} s after start-up")
        # The coordinator commits once every rank's object is in place; a node killed before its own copy
        # of the commit record still holds its objects, and recovery completes the version from the peer.
        newest = max(set().union(*(committed_steps(b) for b in bases)), default=None)
        record["newest_committed"] = newest
        if fault["kind"] in DESTROYS_DATA - {"manager_fail"}:
            record["damage"] = damage(fault, bases, self.rng)
        if code0 == 0 and fault["kind"] not in ("manager_fail", "enospc", "kill_random"):
            return dict(record, outcome="error", why="the fault did not stop incarnation 0")
        if not fault_fired(fault, run_dir, code0):
            return dict(record, outcome="error", why="the fault never fired (a harness error?); see "
                                                     f"{run_dir}/logs-inc0/rank-{fault['rank']}.log")
        code1, seconds1 = self.incarnation(run_dir, bases, 1, None)
        record["incarnation1"] = {"exit": code1, "seconds": round(seconds1, 2)}
        if code1 == STARTUP:
            return dict(record, outcome="startup_timeout", why=self._slow_start("recovery"))
        if code1 is None:
            return dict(record, outcome="hang", why=f"recovery ran past {self.args.timeout} s after start-up")
        results = [read_json(run_dir / f"result-rank{r}-inc1.json") for r in range(NPROC)]
        finals = [read_json(run_dir / f"final-rank{r}-inc1.json") for r in range(NPROC)]
        if code1 != 0 or None in results or None in finals:
            return dict(record, outcome="error", why=f"recovery exited {code1}; see {run_dir}/logs-inc1")
        resumed = {r["resumed_step"] for r in results}  # type: ignore[index]
        sources = {r["source"] for r in results}  # type: ignore[index]
        record.update(resumed_step=sorted(resumed), source=sorted(sources),
                      recover_s=max(r["recover_s"] for r in results))  # type: ignore[index]
        wrong = self._wrong_load(run_dir, results, finals, reference)  # type: ignore[arg-type]
        if wrong:
            return dict(record, outcome="wrong_load", why=wrong)
        step, source = resumed.pop(), sources.pop()
        if source == "ram" and (newest is None or step > newest):
            return dict(record, outcome="wrong_load", why=f"resumed step {step}, which was never committed")
        if source == "ram" and step == newest:
            return dict(record, outcome="recovered_newest")
        if newest is None:
            why = "no RAM version was committed before the fault"
        elif fault["kind"] in DESTROYS_DATA:
            why = "destroyed by the fault"
        else:
            why = "unexplained"
        return dict(record, outcome="fell_back", why=f"{source} step {step} instead of {newest}: {why}")

    def _slow_start(self, which: str) -> str:
        return (f"{which}: a rank's process group was not up within --startup-timeout {self.args.startup_timeout} s "
                "(imports or rendezvous on a loaded machine; no product code had run)")

    @staticmethod
    def _wrong_load(run_dir: Path, results: list[dict[str, Any]], finals: list[dict[str, Any]],
                    reference: list[str]) -> str | None:
        if len({r["resumed_step"] for r in results}) != 1 or len({r["source"] for r in results}) != 1:
            return f"ranks resumed differently: {[(r['resumed_step'], r['source']) for r in results]}"
        for rank, (result, final) in enumerate(zip(results, finals)):
            digests = ledger_digests(run_dir, rank)
            nondeterministic = [s for s, d in digests.items() if len(d) > 1]
            if nondeterministic:
                return f"rank {rank}: steps {nondeterministic} were logged with different states"
            step = result["resumed_step"]
            if step > 0 and result["resumed_digest"] not in digests.get(step, set()):
                return f"rank {rank}: the state loaded for step {step} is not the one saved at step {step}"
            if final["final_digest"] != reference[rank]:
                return f"rank {rank}: the final state differs from the uninterrupted run"
        return None

    def close(self) -> None:
        if not self.args.keep:
            shutil.rmtree(self.ram_root, ignore_errors=True)
            shutil.rmtree(self.disk_root, ignore_errors=True)


def summarize(runs: list[dict[str, Any]], seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    outcomes = Counter(r["outcome"] for r in runs)
    by_kind: dict[str, Counter] = {}
    for r in runs:
        by_kind.setdefault(r["fault"]["kind"], Counter())[r["outcome"]] += 1
    unexplained = sum(1 for r in runs if r["outcome"] == "fell_back" and r["why"].endswith("unexplained"))
    return {
        "runs": len(runs),
        "seed": args.seed,
        "worker": args.worker,
        "seconds": round(seconds, 1),
        "recovered_newest": outcomes["recovered_newest"],
        "fell_back": outcomes["fell_back"],
        "fell_back_unexplained": unexplained,
        "wrong_loads": outcomes["wrong_load"],
        "hangs": outcomes["hang"],
        "startup_timeouts": outcomes["startup_timeout"],
        "errors": outcomes["error"],
        "skipped": outcomes["skipped"],
        "by_kind": {kind: dict(c) for kind, c in sorted(by_kind.items())},
        "problems": [r for r in runs if r["outcome"] in ("wrong_load", "hang", "error", "startup_timeout")
                     or (r["outcome"] == "fell_back" and r["why"].endswith("unexplained"))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=len(KINDS), help=f"runs (default {len(KINDS)}: each kind once)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds one incarnation may take once both ranks have their process group up")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds a rank may take to start (interpreter, imports, rendezvous)")
    parser.add_argument("--startup-delay", type=json.loads, default={}, help=argparse.SUPPRESS)  # tests:
    # {"<incarnation>": {"<rank>": seconds}}, a rank's start-up slowed as heavy load slows imports
    parser.add_argument("--manager-timeout", type=float, default=30.0, help="FLASHPOINT_MANAGER_TIMEOUT_S")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds to draw from")
    parser.add_argument("--ram-dir", default="/dev/shm", help="tmpfs for the nodes' base directories")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (else a table)")
    parser.add_argument("--keep", action="store_true", help="keep every run's files (logs, ledgers, RAM)")
    parser.add_argument("--worker", choices=("persistent", "fork"), default="persistent",
                        help="async saves on the NeMo IO's default persistent worker (up before training) or on a "
                             "worker forked per save (persistent_worker=False)")
    args = parser.parse_args(argv)
    args.startup_delay = {int(inc): delays for inc, delays in args.startup_delay.items()}
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    campaign = Campaign(args)
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    try:
        reference = campaign.reference()
        for index in range(args.runs):
            record = campaign.run(index, kinds[index % len(kinds)], reference)
            runs.append(record)
            print(f"run {index}: {record['fault']} -> {record['outcome']} {record.get('why', '')} "
                  f"{record.get('damage', '')}", file=sys.stderr, flush=True)
    finally:
        campaign.close()
    summary = summarize(runs, time.monotonic() - started, args)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key in ("runs", "recovered_newest", "fell_back", "fell_back_unexplained", "wrong_loads", "hangs",
                    "startup_timeouts", "errors", "skipped", "seconds"):
            print(f"{key:>24}: {summary[key]}")
    return 1 if summary["wrong_loads"] or summary["hangs"] or summary["errors"] or summary["startup_timeouts"] else 0


if __name__ == "__main__":
    sys.exit(main())
