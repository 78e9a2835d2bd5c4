"""Fault tolerance through Megatron-LM's own pretrain_gpt.py (a patched copy of the real
checkout), under chameleon-run on CPU ranks, against Megatron-LM's failure-free run of the
same job: survivors re-plan through Megatron's parallel state and re-enter its loop, state
comes from surviving replicas or, when none holds it, from Megatron-LM's own checkpoint; fp32
pipelines (Adam and SGD) and a bf16 tensor-parallel job."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_support import copy_checkout, free_port, needs_real, patch  # noqa: E402

from chameleon_megatron.resilience.store.announce import read_failures  # noqa: E402
from chameleon_megatron.resilience.store.job_store import JobStore  # noqa: E402

pytestmark = [needs_real, pytest.mark.serial, pytest.mark.timeout(600)]

MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
    "--train-iters 6 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--log-interval 1 --eval-interval 3 --eval-iters 1 --hidden-dropout 0 "
    "--attention-dropout 0"
).split()
JOB = [*MODEL, "--pipeline-model-parallel-size", "2"]
MOE = ["--num-experts", "4", "--disable-bias-linear"]
"""An MoE job with expert parallelism 1: each rank holds every expert."""
TOLERANCE = 1e-4
"""Loss difference allowed against the failure-free run (a new layout sums in another order)."""
BF16_TOLERANCE = 1e-3
"""Relative, in bf16: the new layout sums gradients over other data-parallel groups."""
MEGATRON_ONLY = ("--no-chameleon-ft-plans",)
"""For the tests of megatron layouts (plans: test_megatron_lm_plans.py)."""
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+)")
FINAL = re.compile(r"validation loss at iteration (\d+) on (validation|test) set \| "
                   r"lm loss value: (\S+)")
"""pretrain()'s end-of-job evaluations: (iteration, set, loss)."""


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    ckpt, env = copy_checkout(tmp_path_factory.mktemp("lm") / "Megatron-LM")
    patch.apply(ckpt)
    return ckpt, env


def launch(checkout, out: Path, nproc: int, *extra: str, ft: bool = True,
           job: list[str] = JOB) -> tuple[list[dict], str]:
    """pretrain_gpt.py on ``nproc`` CPU ranks, under chameleon-run (``ft``) or torchrun;
    (metrics records, the job's output)."""
    ckpt, env = checkout
    launcher = "chameleon_megatron.run" if ft else "torch.distributed.run"
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", str(nproc),
           "pretrain_gpt.py", *job, "--chameleon-metrics-file", str(out), *extra]
    run = subprocess.Popen(cmd, env=env, cwd=ckpt, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log = run.communicate(timeout=500)[0]
    finally:  # the launcher's workers go with it
        if run.poll() is None:
            os.killpg(run.pid, 9)
            run.wait()
    out.with_suffix(".log").write_text(log)  # kept under the test's tmp_path for a failure
    assert run.returncode == 0, log[-8000:]
    return [json.loads(line) for line in out.read_text().splitlines()], log


@pytest.fixture(scope="module")
def reference(checkout, tmp_path_factory):
    """Megatron-LM's own run of the job on 4 ranks (PP2 x DP2), no failure, no Chameleon
    fault tolerance: losses by iteration, validation losses by iteration, the end-of-job
    evaluations (``FINAL``)."""
    records, log = launch(checkout, tmp_path_factory.mktemp("ref") / "ref.jsonl", 4, ft=False)
    records = iterations(records)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    finals = FINAL.findall(log)
    assert [f[:2] for f in finals] == [("6", "validation"), ("6", "test")]
    return ({r["iteration"]: r["loss"] for r in records}, dict(VALIDATION.findall(log)),
            finals)


def iterations(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "iteration"]


def recoveries(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "recovery"]


WORK = ("work", "back")
"""The causes of the transitions around work a plan cannot run (Megatron-LM's evaluations
and checkpoints run in a megatron layout, then the plan returns)."""


def changes(records: list[dict]) -> list[dict]:
    """The recoveries, less the transitions around work (``WORK``)."""
    return [r for r in recoveries(records) if r["cause"] not in WORK]


def test_two_failures_recover_in_memory_with_the_losses_of_the_failure_free_run(
        checkout, reference, tmp_path):
    """PP2 x DP2 on 4 ranks. Rank 1 dies during the evaluation after step 3: the survivors
    re-plan (PP1 x DP2, a spare) and redo that evaluation. Rank 2 dies in step 5, the step
    after the new layout's warm-up: the decision, calibrated on that warm-up step, keeps both
    survivors (DP2, the spare receiving its state) rather than one alone. Checkpoints are
    written in every layout."""
    losses, validation, _ = reference
    records, log = launch(
        checkout, tmp_path / "ft.jsonl", 4, "--chameleon-ft", *MEGATRON_ONLY,
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
        "--chameleon-inject-fault", "rank=1,iteration=3,phase=eval,kind=exit",
        "--chameleon-inject-fault", "rank=2,iteration=5,phase=forward,kind=exit")
    steps = iterations(records)
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5, 6]  # each runs exactly once
    for r in steps:
        assert r["loss"] == pytest.approx(losses[r["iteration"]], abs=TOLERANCE), r["iteration"]
    assert [r["world_size"] for r in steps] == [4, 4, 4, 2, 2, 2]
    done = recoveries(records)
    assert [(r["generation"], r["failed_ranks"], r["fallback"], r["redo_iteration"])
            for r in done] == [(1, [1], None, 4), (2, [2], None, 5)]
    assert all(r["layout_after"]["mode"] == "megatron" for r in done)
    assert done[0]["migrated_bytes"] > 0  # state came from the surviving replicas
    assert "the work after step 3 is redone from its evaluation" in log
    assert dict(VALIDATION.findall(log)) == validation  # the same validation batches
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_state_without_a_surviving_copy_comes_from_megatron_lms_checkpoint(
        checkout, reference, tmp_path):
    """PP2 on 2 ranks (no replica): rank 1 dies in step 4; the survivor loads Megatron-LM's
    checkpoint of step 2 into a one-rank layout and redoes steps 3 to 6."""
    losses, _, _ = reference
    records, log = launch(
        checkout, tmp_path / "ft.jsonl", 2, "--chameleon-ft",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
        "--chameleon-inject-fault", "rank=1,iteration=4,phase=forward,kind=exit")
    steps = iterations(records)
    assert [r["iteration"] for r in steps] == [1, 2, 3, 3, 4, 5, 6]
    for r in steps:
        assert r["loss"] == pytest.approx(losses[r["iteration"]], abs=TOLERANCE), r["iteration"]
    (done,) = recoveries(records)
    assert (done["failed_ranks"], done["fallback"], done["redo_iteration"]) == (
        [1], "checkpoint", 3)
    assert done["layout_after"]["ranks"] == [0]
    assert "resumed from the checkpoint of iteration 2" in log


def killed_against_plain(checkout, tmp_path, job: list[str], fault: str, *, nproc: int = 4,
                         ft: tuple[str, ...] = (), **approx: float) -> tuple[list[dict], dict]:
    """Megatron-LM's failure-free run of ``job`` on ``nproc`` ranks, then the same job with
    ``--chameleon-ft`` (and ``ft``) and ``fault``: every step once, each loss
    ``pytest.approx`` the failure-free one (``approx``: its tolerance). Returns the job's
    steps and its recovery."""
    plain = iterations(launch(checkout, tmp_path / "plain.jsonl", nproc, ft=False, job=job)[0])
    records, _ = launch(checkout, tmp_path / "ft.jsonl", nproc, "--chameleon-ft",
                        "--chameleon-inject-fault", fault, *ft, job=job)
    steps = iterations(records)
    assert [r["iteration"] for r in steps] == [r["iteration"] for r in plain]
    for got, want in zip(steps, plain):
        assert got["loss"] == pytest.approx(want["loss"], **approx), got["iteration"]
    (done,) = changes(records)
    return steps, done


def test_a_bf16_tensor_parallel_job_recovers_with_the_failure_free_losses(checkout, tmp_path):
    """TP2 x DP2 in bf16 on 4 ranks (the GPU user's flags: nothing added for the CPU). Rank 3
    dies in backward of step 4: its TP group is broken, the intact one holds a whole replica
    and goes on as TP2 x DP1 with a spare. Against Megatron-LM's failure-free run of the same
    job: every step once, every loss within the bf16 tolerance (measured: bitwise equal)."""
    job = [*MODEL, "--tensor-model-parallel-size", "2", "--bf16"]
    steps, done = killed_against_plain(checkout, tmp_path, job,
                                       "rank=3,iteration=4,phase=backward,kind=exit",
                                       rel=BF16_TOLERANCE, ft=MEGATRON_ONLY)
    assert [r["layout"]["dp"] for r in steps] == [2, 2, 2, 1, 1, 1]
    assert (done["failed_ranks"], done["fallback"], done["redo_iteration"]) == ([3], None, 4)
    lay = done["layout_after"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["ranks"], done["spares"]) == (
        2, 1, 1, [0, 1], [2])


def test_an_sgd_job_recovers_with_its_momentum(checkout, tmp_path):
    """PP2 x DP2 with ``--optimizer sgd`` (momentum 0.9): rank 1 dies in backward of step 3,
    the survivors re-plan and take weights and momentum buffers from the surviving replica.
    Against Megatron-LM's failure-free run of the same job: every step once, every loss
    within 1e-4 (a momentum buffer that did not move would change steps 4-6)."""
    job = [*JOB, "--optimizer", "sgd"]
    _, done = killed_against_plain(checkout, tmp_path, job,
                                   "rank=1,iteration=3,phase=backward,kind=exit", abs=TOLERANCE)
    assert (done["failed_ranks"], done["fallback"], done["redo_iteration"]) == ([1], None, 3)
    assert done["migrated_bytes"] > 0


def test_a_distributed_optimizer_job_recovers_from_its_shard_copies(checkout, tmp_path):
    """PP2 x DP2, MoE with EP = 1 (its experts sharded with the rest, its attention dense),
    with ``--use-distributed-optimizer``: its Adam state is sharded over the two
    replicas, so rank 1's shard lives on only in the host copy its successor (rank 3) took
    after step 2 (copies every 2 steps). Rank 1 dies in backward of step 4: the survivors
    rebuild every unit from the copies, roll back to step 2 (to the start when step 2's
    copies were still being exchanged) and redo the steps since, in the layout the decision
    center picks (a plan leaves for a megatron layout around the evaluation after step 6:
    not this recovery). Against Megatron-LM's failure-free run of the same job: every loss
    within 1e-4, redone ones included."""
    job = [*JOB, *MOE, "--use-distributed-optimizer"]
    plain = iterations(launch(checkout, tmp_path / "plain.jsonl", 4, ft=False, job=job)[0])
    records, _ = launch(checkout, tmp_path / "ft.jsonl", 4, "--chameleon-ft",
                        "--chameleon-ft-shard-replica-interval", "2",
                        "--chameleon-inject-fault", "rank=1,iteration=4,phase=backward,kind=exit",
                        job=job)
    want = {r["iteration"]: r["loss"] for r in plain}
    steps = iterations(records)
    for got in steps:
        assert got["loss"] == pytest.approx(want[got["iteration"]], abs=TOLERANCE), got
    (done,) = changes(records)
    # step 2's copies, or step 0's when step 2's were still being exchanged off the step
    resumed = done["state_from"].get("iteration")
    assert resumed in (2, 0), done
    assert [r["iteration"] for r in steps] == [1, 2, 3, *range(resumed + 1, 7)]
    assert (done["failed_ranks"], done["fallback"], done["redo_iteration"]) == \
        ([1], None, resumed + 1)
    assert done["state_from"] == {"source": "shard copies", "iteration": resumed,
                                  "rolled_back_steps": 3 - resumed, "replicas_of": [1]}, done


def killed_at_the_end(checkout, reference, tmp_path, fault: str,
                      *extra: str) -> tuple[dict, str]:
    """The reference job with ``--chameleon-ft`` and ``fault`` in pretrain()'s end-of-job
    work: it ends with exit 0 (``launch``), every step once with the failure-free losses, and
    end-of-job evaluations equal to the failure-free ones (redone ones included). Returns
    the recovery and the job's output."""
    losses, _, finals = reference
    records, log = launch(checkout, tmp_path / "ft.jsonl", 4, "--chameleon-ft", *MEGATRON_ONLY,
                          "--chameleon-inject-fault", fault, *extra)
    steps = iterations(records)
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert r["loss"] == pytest.approx(losses[r["iteration"]], abs=TOLERANCE), r["iteration"]
    got = FINAL.findall(log)
    assert [g[:2] for g in got] == [f[:2] for f in finals], got  # each once
    for (_, which, loss), (_, _, want) in zip(got, finals):
        assert float(loss) == pytest.approx(float(want), abs=TOLERANCE), which
    (done,) = recoveries(records)
    assert (done["failed_ranks"], done["fallback"]) == ([1], None), done
    return done, log


def test_a_failure_in_the_final_checkpoint_is_recovered(checkout, reference, tmp_path):
    """PP2 x DP2 saving every 4 steps, so pretrain() writes a final checkpoint of step 6
    after its loop: rank 1 dies as it starts. The survivors re-plan, write it again in the
    new layout, and the checkpoint is complete: every tensor its metadata names loads."""
    ckpt = tmp_path / "ckpt"
    _, log = killed_at_the_end(checkout, reference, tmp_path,
                               "rank=1,iteration=6,phase=final-save,kind=exit",
                               "--save", str(ckpt), "--save-interval", "4")
    assert "the work after step 6 is redone from its final checkpoint" in log
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    loaded = load_every_tensor(ckpt / "iter_0000006")
    assert any(name.startswith("decoder.layers") for name in loaded), sorted(loaded)[:5]


def load_every_tensor(path: Path) -> dict:
    """Every tensor of a torch_dist checkpoint, read back in this process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    tensors = {name: torch.full(m.size, float("nan"), dtype=m.properties.dtype)
               for name, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    bad = [name for name, t in tensors.items() if t.is_floating_point() and t.isnan().any()]
    assert not bad, f"not written: {bad[:5]}"
    return tensors


def test_a_hang_in_the_final_validation_is_recovered(checkout, reference, tmp_path):
    """Rank 1 hangs as pretrain()'s evaluation on the validation set after step 6 starts:
    the survivors redo it on the same batches, then evaluate the test set. The hang is found
    by the survivors' collectives timing out (the groups' timeout during the work after the
    last step is the start-up one, 60 s here; the heartbeat allows twice that, so they are
    not killed first as silent). A rank that exits there: test_megatron_lm_019.py."""
    _, log = killed_at_the_end(checkout, reference, tmp_path,
                               "rank=1,iteration=6,phase=final-eval,kind=hang",
                               "--chameleon-ft-startup-timeout-s", "60")
    assert "the work after step 6 is redone from its final validation" in log


def test_an_exception_in_the_final_test_evaluation_is_recovered(checkout, reference,
                                                                tmp_path):
    """Rank 1 raises as pretrain()'s evaluation on the test set starts: the survivors redo
    it alone (the validation is not evaluated twice)."""
    _, log = killed_at_the_end(checkout, reference, tmp_path,
                               "rank=1,iteration=6,phase=final-test,kind=exception")
    assert "the work after step 6 is redone from its final test" in log


JOIN_ITERS = 16
PACED = range(4, 14)
"""Steps rank 0 makes slow (3 s each): the joiner (a new Megatron-LM process, some 5 to 30 s
to start) is admitted well before the last step."""
JOIN_JOB = [*JOB[:JOB.index("--train-iters") + 1], str(JOIN_ITERS),
            *JOB[JOB.index("--train-iters") + 2:]]
JOIN_FT = ["--chameleon-ft", *MEGATRON_ONLY, "--chameleon-inject-fault",
           "rank=3,iteration=3,phase=forward,kind=exit",
           *(a for i in PACED for a in ("--chameleon-inject-fault",
                                        f"rank=0,iteration={i},phase=forward,kind=slow,seconds=3"))]


@pytest.fixture(scope="module")
def join_reference(checkout, tmp_path_factory):
    """Megatron-LM's failure-free run of the join tests' job: (metrics records, output)."""
    return launch(checkout, tmp_path_factory.mktemp("join-ref") / "plain.jsonl", 4, ft=False,
                  job=JOIN_JOB)


def respawned_joins(checkout, plain: tuple[list[dict], str], tmp_path) -> None:
    """PP2 x DP2 on 4 ranks; rank 3 dies in step 3. chameleon-run restarts its slot as a
    joiner (``--chameleon-ft-respawns 1``): a new pretrain_gpt.py whose pretrain() stops
    after Megatron-LM's arguments and holds nothing until invited. The survivors re-plan
    (3 ranks: DP2, a spare), then admit the joiner between two steps: four ranks again,
    every step once, every loss, validation and end-of-job evaluation that of ``plain``,
    Megatron-LM's failure-free run. Run on 0.19 (test_megatron_lm_019.py); on 0.16 a new
    node joins below."""
    joined = launch(checkout, tmp_path / "ft.jsonl", 4, *JOIN_FT, "--chameleon-ft-respawns",
                    "1", "--chameleon-ft-respawn-delay-s", "0", job=JOIN_JOB)
    assert_grown_back(plain, joined)


PLANS_FT = [a for a in JOIN_FT if a not in MEGATRON_ONLY] + ["--chameleon-ft-strategy",
                                                            "replan"]
"""JOIN_FT with the forced re-plan: the survivors run a heterogeneous plan until the join."""


@pytest.mark.parametrize("ft", [JOIN_FT, PLANS_FT], ids=["megatron", "plan"])
def test_a_new_node_joins_and_the_layout_grows_back(checkout, join_reference, tmp_path, ft):
    """The same job on a static rendezvous, without respawns: once rank 3's failure is
    announced, a second chameleon-run (one worker, ``--chameleon-ft-join``) joins it through
    the job store; the layout grows back as with a respawned worker. The survivors run a
    megatron layout until then, or (``plan``) a heterogeneous plan."""
    ckpt, env = checkout
    out = tmp_path / "ft.jsonl"
    port = free_port()
    rdzv = ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}", "--rdzv-id=lm"]

    def node(nproc: int, *extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "chameleon_megatron.run", *rdzv, "--nproc-per-node",
               str(nproc), "pretrain_gpt.py", *JOIN_JOB, "--chameleon-metrics-file", str(out),
               *ft, *extra]
        log = open(tmp_path / f"node{nproc}.log", "w")
        return subprocess.Popen(cmd, env=env, cwd=ckpt, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    first = node(4)
    second = None
    try:
        job = JobStore.connect("127.0.0.1", port, "lm", timeout_s=120)
        deadline = time.monotonic() + 240
        while not read_failures(job) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_failures(job), (tmp_path / "node4.log").read_text()[-4000:]
        second = node(1, "--chameleon-ft-join")
        assert first.wait(timeout=400) == 0, (tmp_path / "node4.log").read_text()[-6000:]
        assert second.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-6000:]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    log = (tmp_path / "node4.log").read_text() + (tmp_path / "node1.log").read_text()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert_grown_back(join_reference, (records, log))
    assert '"event": "node_join", "group_rank": 1' in (tmp_path / "node1.log").read_text()
    failure = changes(records)[0]
    assert failure["layout_after"]["mode"] == ("megatron" if ft is JOIN_FT else "hetero")


def assert_grown_back(plain: tuple[list[dict], str], joined: tuple[list[dict], str]) -> None:
    """Rank 3 failed in step 3, a joiner came in (join id 4): four ranks again, every step
    once, every loss, validation and end-of-job evaluation that of the failure-free run;
    the joiner built no model before it was invited."""
    (plain, plain_log), (records, log) = plain, joined
    steps = iterations(records)
    assert [r["iteration"] for r in steps] == list(range(1, JOIN_ITERS + 1)), log[-4000:]
    for got, want in zip(steps, iterations(plain)):
        assert got["loss"] == pytest.approx(want["loss"], abs=TOLERANCE), got["iteration"]
    evaluations = {(it, ""): v for it, v in VALIDATION.findall(log)} | {
        (it, which): v for it, which, v in FINAL.findall(log)}
    wanted = {(it, ""): v for it, v in VALIDATION.findall(plain_log)} | {
        (it, which): v for it, which, v in FINAL.findall(plain_log)}
    assert evaluations.keys() == wanted.keys()  # the same evaluations, each once
    assert len(VALIDATION.findall(log) + FINAL.findall(log)) == len(wanted)
    for key, value in wanted.items():
        assert float(evaluations[key]) == pytest.approx(float(value), abs=TOLERANCE), key
    failure, join = changes(records)
    assert (failure["cause"], failure["failed_ranks"]) == ("failure", [3])
    assert (join["cause"], join["joined"], join["failed_ranks"]) == ("join", [4], [])
    assert join["layout_after"]["mode"] == "megatron"
    assert sorted(join["layout_after"]["ranks"]) == [0, 1, 2, 4]
    assert join["migrated_bytes"] > 0  # the joiner's state came from the survivors
    sizes = [(r["iteration"] >= join["redo_iteration"], r["world_size"]) for r in steps]
    # a megatron layout of 2 ranks after the failure (a plan runs 3, evaluations 2)
    plan = failure["layout_after"]["mode"] != "megatron"
    assert sorted(set(sizes)) == [(False, 2), *[(False, 3)] * plan, (False, 4), (True, 4)]
    # the joiner's pretrain() never built a model of its own: only the first four did
    assert log.count('"event": "chameleon_megatron_lm_hook"') == 4
