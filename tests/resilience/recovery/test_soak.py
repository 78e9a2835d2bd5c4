"""Soak: one job through a seeded random sequence of failures, against a failure-free run.

8 ranks (DP4 x PP2), 200 steps, evaluation every 10 steps, a checkpoint every 20. Every
launch rank fails once (exit, hang or exception), in forward, backward, optimizer, recovery,
evaluation or checkpoint save, one of them in the first 3 steps, some back to back; the
agent restarts each failed worker, which joins the job again. Every step runs once (a step
every survivor applied before the failure surfaced is kept, not redone), every loss is the
reference's, every rank holding the model at the end holds the reference's weights and Adam
moments, and nothing is left running.

``test_soak_random_seed`` draws a new seed and names it on failure;
``CHAMELEON_SOAK_SEED=<seed>`` replays one; ``test_soak_replays_seeds_that_found_bugs``
replays the seeds that found bugs. The soak jobs (a few minutes each) run only with
``CHAMELEON_SOAK=1``, not in the default suite yet (see ``FOUND_BUGS``); the schedule's own
test is. Not covered here: a whole node's agent
killed, and a new node joining (``launch/test_launcher.py``, ``test_adaptive_e2e.py``).
"""

from __future__ import annotations

import math
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import FT, assert_losses_match, faults, launch, run_reference  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]
soak_job = pytest.mark.skipif(not os.environ.get("CHAMELEON_SOAK"),
                              reason="soak jobs run with CHAMELEON_SOAK=1")

ITERS = 200
RANKS = 8
EVAL_EVERY, SAVE_EVERY = 10, 20
FLAGS = ("--micro-batch-size", "1", "--global-batch-size", "16", "--eval-interval",
         str(EVAL_EVERY), "--eval-iters", "1")
TIED = {"output|output_layer.weight": "embedding|word_embeddings.weight"}
"""A last stage's copy of the tied word embeddings (one process has none)."""
FOUND_BUGS = (384601,)
"""Seeds that found a bug. 384601: after a hang and a failure during its recovery, members of
one attempt stayed blocked in gloo's rendezvous of the new world (store waits, which the
retry key did not interrupt) while others moved on; each then waited out a doubled window in
a different generation until none was left. Attempts now wait by polling the store and leave
when the attempt is abandoned, and pass a store barrier before each group rendezvous; with
that (and the tests' 20 s windows) the seed passes (3 min, 13 recoveries), though no
abandoned wait fired in that replay, so it does not prove which change made the difference.
Fixed on the way: joiners waited with their start-up window (160 s, the members' 12 s) and a
heartbeat hold shorter than their window, and were killed as hung."""


def schedule(seed: int) -> list[str]:
    """One fault per launch rank, spread over the run: one in the first 3 steps, one in
    each of forward, backward, optimizer, evaluation and save, one during the recovery of
    another (back to back), kinds drawn (a hang only inside a step after the first 3: before
    a step time is known, and outside steps, the heartbeat allows twice the start-up
    timeout)."""
    rng = random.Random(seed)
    ranks = list(range(RANKS))
    rng.shuffle(ranks)
    slots = sorted(rng.sample(range(1, 9), 6))  # six later faults, one per ~25 steps
    steps = [s * 22 + rng.randrange(0, 4) for s in slots]
    plan = [(rng.choice([2, 3]), rng.choice(["forward", "backward"]))]
    plan += [(it, phase) for it, phase in zip(
        steps, rng.sample(["forward", "backward", "optimizer", "eval", "save", "forward"], 6))]
    out = []
    for rank, (it, phase) in zip(ranks, plan):
        if phase == "eval":
            it -= it % EVAL_EVERY or EVAL_EVERY
        elif phase == "save":
            it -= it % SAVE_EVERY or SAVE_EVERY
        hangs = phase in ("forward", "backward") and it > 3
        kinds = ["exit", "exception"] + (["hang"] if hangs else [])
        out.append(f"rank={rank},iteration={it},phase={phase},kind={rng.choice(kinds)}")
    # the last rank fails during the recovery that redoes the step of a later fault in
    # forward or backward (back to back)
    host = next(f for f in out[1:] if "phase=forward" in f or "phase=backward" in f)
    redo = host.split("iteration=")[1].split(",")[0]
    out.append(f"rank={ranks[7]},iteration={redo},phase=recovery,"
               f"kind={rng.choice(['exit', 'exception'])}")
    return out


def test_the_schedule_covers_what_the_soak_promises() -> None:
    for seed in range(50):
        plan = schedule(seed)
        assert len(plan) == RANKS and len({p.split(",")[0] for p in plan}) == RANKS
        text = " ".join(plan)
        for phase in ("forward", "backward", "optimizer", "eval", "save", "recovery"):
            assert f"phase={phase}" in text, (seed, plan)
        its = [int(p.split("iteration=")[1].split(",")[0]) for p in plan]
        assert min(its) <= 3 and max(its) < ITERS and "rank=0," in text, (seed, plan)
        assert all("kind=hang" not in p for p in plan
                   if "phase=eval" in p or "phase=save" in p or "phase=recovery" in p
                   or int(p.split("iteration=")[1].split(",")[0]) <= 3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict]:
    return run_reference(tmp_path_factory.mktemp("soak-reference"), ITERS, FLAGS)


def soak(seed: int, reference, tmp: Path) -> None:
    ref_losses, ref_dump = reference
    plan = schedule(seed)
    try:
        recs, dumps, log = launch(tmp, RANKS, [
            "--pipeline-model-parallel-size", "2", *FLAGS, "--save", str(tmp / "ckpt"),
            "--save-interval", str(SAVE_EVERY), *FT, "--chameleon-ft-startup-timeout-s", "40",
            "--chameleon-ft-respawns", str(RANKS), "--chameleon-ft-respawn-delay-s", "0",
            *faults(*plan)], timeout_s=840, iters=ITERS)
        check(recs, dumps, log, ref_losses, ref_dump)
    except AssertionError as exc:
        raise AssertionError(f"soak seed {seed} (CHAMELEON_SOAK_SEED={seed} replays it), "
                             f"faults {plan}: {exc}") from None


def check(recs: list[dict], dumps: dict, log: str, ref_losses: dict, ref_dump: dict) -> None:
    seen = assert_losses_match(recs, ref_losses)
    assert seen == sorted(set(seen)) and seen[-1] == ITERS, (seen, log[-4000:])
    kept = {r["redo_iteration"] - 1 for r in recs if r["event"] == "recovery"}
    missing = set(range(1, ITERS + 1)) - set(seen)
    assert missing <= kept, (sorted(missing), sorted(kept))
    fired = log.count("injecting fault")
    assert fired >= RANKS - 2, f"only {fired} faults fired"
    holders = {r: d for r, d in dumps.items() if not d.get("spare")}
    assert holders, dumps
    want = ref_dump["sums"]
    covered: set[str] = set()
    for rank, dump in holders.items():
        for key, got in dump["sums"].items():
            w = want[TIED.get(key, key)]
            assert got["step"] == w["step"], (rank, key, got["step"], w["step"])
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert math.isclose(got[k], w[k], rel_tol=1e-4, abs_tol=1e-30), (rank, key, k)
            covered.add(TIED.get(key, key))
    assert covered >= set(want), sorted(set(want) - covered)


@soak_job
def test_soak_random_seed(reference, tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAMELEON_SOAK_SEED") or random.SystemRandom().randrange(10**6))
    print(f"soak seed {seed}")
    soak(seed, reference, tmp_path)


@soak_job
@pytest.mark.parametrize("seed", FOUND_BUGS)
def test_soak_replays_seeds_that_found_bugs(seed: int, reference, tmp_path: Path) -> None:
    soak(seed, reference, tmp_path)
