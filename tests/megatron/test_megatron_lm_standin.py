"""chameleon_megatron.megatron_lm's hook on a patched synthetic checkout and a small stand-in
``megatron.training`` package whose ``pretrain`` parses flags and runs a 3-iteration loop
through the same seams as Megatron-LM (setup_model_and_optimizer, the data iterators, train,
train_step, the schedule, evaluate_and_print_results), in real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core import package_info

from chameleon_megatron.metrics_file import read_metrics, run_ids
from chameleon_megatron.resilience.store.env import AGENT_ENV, JOIN_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_support import REPO, free_port, make_checkout, patch  # noqa: E402

pytestmark = pytest.mark.timeout(120)


STANDIN_INIT = '''\
"""Test stand-in for Megatron-LM's megatron.training (only what the hook touches)."""
from megatron.training import arguments
from megatron.training.training import pretrain


def maybe_wrap(pretrain):
    arguments.parse_args(ignore_unknown_args=True)
    return pretrain, None
'''

STANDIN_ARGUMENTS = '''\
import argparse

import torch


def get_device_arch_version():  # imported from megatron.training.utils; CUDA only
    return torch.cuda.get_device_properties(torch.device("cuda:0")).major


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--train-iters", type=int, default=3)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    parser.add_argument("--rampup-batch-size", nargs="*")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--cpu-offloading-num-layers", type=int, default=0)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_known_args()[0] if ignore_unknown_args else parser.parse_args()
'''

STANDIN_INITIALIZE = '''\
import torch

from megatron.training.arguments import parse_args


def initialize_megatron(extra_args_provider=None, allow_no_cuda=False):
    if not allow_no_cuda:
        assert torch.cuda.is_available(), "Megatron requires CUDA."
    args = parse_args(extra_args_provider)
    torch.distributed.init_process_group("gloo")
    _compile_dependencies()
    return args


def _compile_dependencies():
    from torch.utils import cpp_extension
    assert cpp_extension.CUDA_HOME is not None, "fused kernels need nvcc"
'''

STANDIN_TRAINING = '''\
"""Test stand-in for megatron.training.training: pretrain() -> setup -> iterators -> train."""
import types

import torch

from megatron.core.timers import Timers
from megatron.training.initialize import initialize_megatron

ARGS = None
TIMERS = Timers(0, "max")
EVAL_AFTER = 2  # evaluate after this many steps

mpu = types.SimpleNamespace(
    get_tensor_model_parallel_rank=lambda: 0,
    get_pipeline_model_parallel_rank=lambda: torch.distributed.get_rank(),
    get_pipeline_model_parallel_world_size=lambda: torch.distributed.get_world_size(),
    get_pipeline_model_parallel_group=lambda: torch.distributed.group.WORLD,
    get_data_parallel_rank=lambda: 0,
)


def get_args():
    return ARGS


def get_timers():
    return TIMERS


def get_model_config(model):
    return f"config:{type(model).__name__}"


def get_num_microbatches():
    return 2


def num_floating_point_operations(args, batch_size):
    return 0.0


def load_checkpoint(model, optimizer, opt_param_scheduler, checkpointing_context=None):
    raise AssertionError("nothing to load")


def get_optimizer_param_scheduler(optimizer):  # a plan's schedule: no plan runs here
    raise AssertionError("no plan runs in the stand-in")


def build_train_valid_test_datasets(provider):  # a plan's data
    raise AssertionError("no plan runs in the stand-in")


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far, checkpointing_context=None,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None):
    raise AssertionError("no --save")


def preprocess_common_state_dict(common_state_dict):
    return common_state_dict


def print_datetime(string, override_timestamp=None):  # Megatron-LM's waits for every rank
    torch.distributed.barrier()


def save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                             num_floating_point_operations_so_far, checkpointing_context,
                             train_data_iterator=None):
    save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                    num_floating_point_operations_so_far, checkpointing_context,
                    train_data_iterator=train_data_iterator)


def setup_model_and_optimizer(model_provider_func, model_type, checkpointing_context=None):
    return [torch.nn.Linear(2, 2)], "optimizer", "scheduler"


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    return iter(()), iter(()), None


def get_forward_backward_func(pp_size=None, vp_size=None):
    def forward_backward(*, forward_step_func, forward_only=False):
        return []
    return forward_backward


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
               forward_backward_func, iteration=None):
    forward_backward_func(forward_step_func=forward_step_func, forward_only=False)
    last = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    loss = {"lm loss": torch.tensor(10.0 + iteration)} if last else {}
    return loss, 0, False, False, 0, None, None, 0


def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, iteration,
                               process_non_loss_data_func, config, verbose=False,
                               write_to_tensorboard=True, non_loss_data_func=None):
    get_forward_backward_func()(forward_step_func=forward_step_func, forward_only=True)


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
          valid_data_iterator, process_non_loss_data_func, config, checkpointing_context,
          non_loss_data_func):
    schedule = get_forward_backward_func()
    iteration = ARGS.iteration
    while iteration < ARGS.train_iters:
        ARGS.curr_iteration = iteration
        train_step(forward_step_func, train_data_iterator, model, optimizer,
                   opt_param_scheduler, config, schedule, iteration=iteration)
        iteration += 1
        ARGS.consumed_train_samples += 4
        if iteration == EVAL_AFTER:
            evaluate_and_print_results(f"iteration {iteration}", forward_step_func,
                                       valid_data_iterator, model, iteration, None, config)
    return iteration, 0.0


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             extra_args_provider=None, store=None):
    global ARGS
    ARGS = initialize_megatron(extra_args_provider)
    ARGS.data_parallel_size, ARGS.virtual_pipeline_model_parallel_size = 1, None
    ARGS.consumed_train_samples, ARGS.consumed_valid_samples, ARGS.iteration = 0, 0, 0
    ARGS.num_floating_point_operations_so_far = 0.0
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, model_type, {})
    train_it, valid_it, _ = build_train_valid_test_data_iterators(
        train_valid_test_dataset_provider)
    train(forward_step_func, model, optimizer, scheduler, train_it, valid_it, None,
          get_model_config(model[0]), {}, None)
    torch.distributed.destroy_process_group()
'''

DRIVER = '''\
"""Runs a patched pretrain_gpt.py with a recording plugin; writes what it saw to $OUT."""
import contextlib
import json
import os
import runpy
import sys

import megatron.training.training as training
import torch
from chameleon_megatron import megatron_lm
from chameleon_megatron.training import lm_hook
from chameleon_megatron.training.plugin import TrainerPlugin


class Recorder(TrainerPlugin):
    def __init__(self):
        self.events = []

    def on_model_built(self, ctx):
        self.events.append(["built", ctx.rank, ctx.pp_rank, ctx.pp_size, ctx.vpp_size,
                            str(ctx.device), ctx.config, sorted(ctx.extra)])

    @contextlib.contextmanager
    def step_context(self, iteration, *, training):
        self.events.append(["enter", iteration, training])
        yield
        self.events.append(["exit", iteration, training])

    def metrics(self):
        return {"probe": len(self.events)}

    def on_train_end(self):
        self.events.append(["end"])


recorder = Recorder()
seen = {}


def build(config):
    seen["budget_fraction"] = config.swap.budget_fraction
    return [recorder]


megatron_lm.plugins_for = build
originals = {n: getattr(training, n) for n in (*lm_hook.WRAPPED, "initialize_megatron")}
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
out = {
    "events": recorder.events,
    "restored": all(getattr(training, n) is f for n, f in originals.items()),
    "cuda_restored": torch.cuda.device_count() == 0,
    "num_layers": training.ARGS.num_layers,
    "hidden_size": training.ARGS.hidden_size,
    **seen,
}
with open(os.path.join(os.environ["OUT"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(out, f)
'''


@pytest.fixture
def standin(tmp_path):
    """A patched synthetic checkout plus a stand-in megatron.training on PYTHONPATH."""
    ckpt = make_checkout(tmp_path / "mlm")
    patch.apply(ckpt)
    pkg = tmp_path / "standin" / "megatron" / "training"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STANDIN_INIT)
    (pkg / "arguments.py").write_text(STANDIN_ARGUMENTS)
    (pkg / "initialize.py").write_text(STANDIN_INITIALIZE)
    (pkg / "training.py").write_text(STANDIN_TRAINING)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "standin"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    return ckpt, env


def test_patched_script_help_lists_the_chameleon_flags_it_supports(standin):
    ckpt, env = standin
    out = subprocess.run([sys.executable, str(ckpt / "pretrain_gpt.py"), "--help"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for flag in ("--num-layers", "--chameleon-config", "--chameleon-swap",
                 "--chameleon-metrics-file", "--chameleon-ft", "--chameleon-inject-fault"):
        assert flag in out
    # new members are admitted on this path too
    assert "--chameleon-ft-join" in out and "--chameleon-ft-respawns" in out


@pytest.mark.parametrize("flags, message", [
    (["--chameleon-ft", "--chameleon-ft-respawns", "-1", "AGENT"], "ft.respawns=-1: must be >= 0"),
    (["--chameleon-swap-budget-fraction", "2"], "swap.budget_fraction=2.0"),
    (["--chameleon-ft"], "--chameleon-ft: needs the chameleon-run launcher"),
    (["--chameleon-ft", "--chameleon-ft-shard-replica-interval", "0", "AGENT"],
     "ft.shard_replica_interval=0: must be >= 1"),
    (["--chameleon-swap", "JOINER"], "CHAMELEON_FT_JOIN_ID is set (a joiner) but --chameleon-ft "
     "is not"),
    (["PRESET", "AGENT"], "ft.shard_replica_interval=0: must be >= 1"),  # the preset is read
    (["--chameleon-ft", "--context-parallel-size", "2", "AGENT"],
     "--chameleon-ft: --context-parallel-size 2: recovery rebuilds tensor, pipeline and data "
     "parallelism only"),
    (["--chameleon-swap", "--cpu-offloading-num-layers", "1"],
     "--chameleon-swap with --cpu-offloading-num-layers 1: Megatron's activation offloading"),
    (["--chameleon-metrics-file", "USED"], "already holds a run; give --chameleon-metrics-append"),
    (["--chameleon-ft", "--chameleon-inject-fault", "rank=1,iteration=2,phase=final-save,kind=exit",
      "AGENT"], "phase=final-save needs iteration=3 (--train-iters, the last step)"),
])
def test_what_this_path_cannot_run_is_refused_in_one_line_before_the_model(
        standin, tmp_path, flags, message):
    ckpt, env = standin
    preset = tmp_path / "ft.yaml"
    preset.write_text("ft:\n  enabled: true\n  respawns: 2\n  shard_replica_interval: 0\n")
    agent = {AGENT_ENV: "1"} if "AGENT" in flags else {}  # as if under chameleon-run
    agent |= {JOIN_ENV: "4"} if "JOINER" in flags else {}  # as if a restarted worker
    flags = [f for f in flags if f not in ("AGENT", "JOINER")]
    flags = ["--chameleon-config", str(preset)] if flags == ["PRESET"] else flags
    used = tmp_path / "used.jsonl"
    used.write_text('{"event": "run", "run_id": 1}\n')
    flags = [str(used) if f == "USED" else f for f in flags]
    run = subprocess.run([sys.executable, str(tmp_path / "driver.py"),
                          str(ckpt / "pretrain_gpt.py"), *flags],
                         env={**env, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(free_port()), "OUT": str(tmp_path), **agent},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and message in errors[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "rank0.json").exists()  # pretrain() never got to the model


def test_hook_drives_plugins_and_metrics_across_two_ranks(standin, tmp_path):
    ckpt, env = standin
    metrics = tmp_path / "runs" / "metrics.jsonl"
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        "megatron:\n  num_layers: 3\n  hidden_size: 64\n"
        f"swap:\n  budget_fraction: 0.25\nmetrics:\n  file: {metrics}\n"
    )
    argv = [str(ckpt / "pretrain_gpt.py"), "--chameleon-config", str(preset),
            "--hidden-size", "128", "--chameleon-swap-budget-fraction", "0.75",
            "--pipeline-model-parallel-size", "2"]
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "driver.py"), *argv],
            env={**env, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "OUT": str(tmp_path)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    try:
        logs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], logs

    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    # YAML megatron section -> defaults, CLI wins; same for chameleon sections.
    assert (rank0["num_layers"], rank0["hidden_size"], rank0["budget_fraction"]) == (3, 128, 0.75)
    # the seams, and on this CPU host the platform's stand-ins, are restored afterwards
    assert rank0["restored"] and rank1["restored"]
    assert rank0["cuda_restored"] and rank1["cuda_restored"]
    # training: the step being computed (1-based); evaluation: the steps completed
    steps = [["enter", 1, True], ["exit", 1, True], ["enter", 2, True], ["exit", 2, True],
             ["enter", 2, False], ["exit", 2, False], ["enter", 3, True], ["exit", 3, True],
             ["end"]]
    extra = ["opt_param_scheduler", "optimizer"]
    assert rank0["events"] == [["built", 0, 0, 2, 1, "cpu", "config:Linear", extra], *steps]
    assert rank1["events"] == [["built", 1, 1, 2, 1, "cpu", "config:Linear", extra], *steps]

    run, *records = [json.loads(line) for line in metrics.read_text().splitlines()]
    # the run record, as chameleon's trainer writes it (chameleon profile reads its args)
    assert (run["event"], run["run_id"], run["world_size"]) == ("run", 1, 2)
    assert (run["args"]["num_layers"], run["args"]["hidden_size"]) == (3, 128)
    assert run["versions"] == {"torch": torch.__version__,
                               "megatron_core": package_info.__version__}
    assert not any(k.startswith("chameleon") for k in run["args"])
    layout = {"tp": 1, "pp": 2, "vpp": 1, "dp": 1}
    # loss comes from the last rank (rank 0 reports none); consumed = 4 per step;
    # probe = events rank 0's plugin had seen when metrics() was called after each step.
    assert [(r["event"], r["iteration"], r["loss"], r["consumed_samples"], r["world_size"],
             r["layout"], r["probe"]) for r in records] == [
        ("iteration", 1, 10.0, 4, 2, layout, 3),
        ("iteration", 2, 11.0, 8, 2, layout, 5),
        ("iteration", 3, 12.0, 12, 2, layout, 9),
    ]
    assert all(r["step_time_s"] > 0 for r in records)


def test_a_used_metrics_file_takes_another_run_only_when_appended(standin, tmp_path):
    """As on chameleon's trainer: a file holding a run is refused (exit 2, one line) unless
    --chameleon-metrics-append; then the new run has the next run_id, and readers take it."""
    ckpt, env = standin
    metrics = tmp_path / "m.jsonl"

    def train(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(tmp_path / "driver.py"), str(ckpt / "pretrain_gpt.py"),
             "--num-layers", "2", "--chameleon-metrics-file", str(metrics), *flags],
            env={**env, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port()), "OUT": str(tmp_path)},
            capture_output=True, text=True, timeout=60)

    assert train().returncode == 0
    refused = train()
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"--chameleon-metrics-file {metrics}: already holds a run" in refused.stderr
    assert run_ids(metrics) == [1]
    assert train("--chameleon-metrics-append").returncode == 0
    assert run_ids(metrics) == [1, 2]
    for run in (1, 2):
        assert [(r["iteration"], r["run_id"]) for r in read_metrics(metrics, "iteration",
                                                                     run=run)] == [
            (1, run), (2, run), (3, run)]
    assert read_metrics(metrics, "run")[0]["run_id"] == 2  # the last run by default
