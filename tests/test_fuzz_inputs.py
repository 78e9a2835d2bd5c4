"""Every input a user can give either runs or ends in one ``error:`` line with exit 2.

Property tests over the trainer's flags (every option of its parser, with values drawn from
a pool of valid, out-of-range and malformed ones), the YAML presets (each preset with a key
replaced, removed or added), ``--chameleon-inject-fault`` specs and ``chameleon-run``'s
process counts. The checks are the entries' own (``checked_args``, ``checked_launch``), run
in-process: anything but a clean pass or ``SystemExit(2)`` with one error line is a bug.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chameleon_megatron import run as launcher
from chameleon_megatron.pretrain_gpt import checked_args
from chameleon_megatron.resilience.store.env import AGENT_ENV
from chameleon_megatron.training.arguments import build_parser
from dist_utils import TINY as _TINY

pytestmark = pytest.mark.timeout(600)

TINY = [*_TINY, "--train-iters", "2"]

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "configs").glob("*.yaml"))
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

VALUES = ["-1", "0", "1", "2", "3", "8", "1000000000", "0.5", "1e-3", "-0.1", "nan", "inf",
          "", "abc", "1,2", "1:2", "true", "none", "/no/such/file", "rank=1", "0x10"]
OPTIONS = sorted(
    (a.option_strings[-1], a.nargs)
    for a in build_parser()._actions
    if a.option_strings and a.option_strings[0] not in ("-h", "--help")
)
FAULT_FIELDS = {"rank": ["0", "1", "3", "-1", "99", "x"], "iteration": ["0", "1", "5", "-2", "y"],
                "phase": ["forward", "backward", "optimizer", "grads", "between", "nowhere"],
                "kind": ["exit", "hang", "exception", "oom", "boom"]}


@contextlib.contextmanager
def under_agent(on: bool):
    """As a worker of chameleon-run's agent (``--chameleon-ft`` needs one) or not."""
    before = os.environ.get(AGENT_ENV)
    os.environ.pop(AGENT_ENV, None)
    if on:
        os.environ[AGENT_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(AGENT_ENV, None)
        if before is not None:
            os.environ[AGENT_ENV] = before


def outcome(check, *argv_and_more) -> str:
    """"ok", or the one error line; fails the test on anything else."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            check(*argv_and_more)
    except SystemExit as exc:
        lines = [line for line in err.getvalue().splitlines() if "error" in line.lower()]
        assert exc.code == 2, (argv_and_more, exc.code, err.getvalue())
        assert len(lines) == 1 and ": error: " in lines[0], (argv_and_more, err.getvalue())
        return lines[0]
    return "ok"


def _values(nargs) -> st.SearchStrategy[list[str]]:
    if nargs == 0:
        return st.just([])
    if nargs in ("+", "*") or isinstance(nargs, int):
        return st.lists(st.sampled_from(VALUES), min_size=1, max_size=3)
    return st.sampled_from(VALUES).map(lambda v: [v])


@st.composite
def trainer_argv(draw) -> list[str]:
    argv = list(TINY)
    for flag, nargs in draw(st.lists(st.sampled_from(OPTIONS), min_size=1, max_size=4)):
        argv += [flag] if nargs == 0 else [flag, *draw(_values(nargs))]
    return argv


@st.composite
def fault_spec(draw) -> str:
    fields = draw(st.lists(st.sampled_from(sorted(FAULT_FIELDS)), min_size=0, max_size=5))
    return ",".join(f"{k}={draw(st.sampled_from(FAULT_FIELDS[k]))}" for k in fields)


@given(argv=trainer_argv(), world=st.sampled_from([1, 2, 3, 4, 8]), agent=st.booleans())
@FUZZ
def test_any_trainer_flags_run_or_end_in_one_line(argv, world, agent):
    with under_agent(agent):
        outcome(lambda: checked_args(argv, world))


@given(specs=st.lists(fault_spec(), min_size=1, max_size=3), world=st.sampled_from([2, 4]),
       ft=st.lists(st.sampled_from([["--chameleon-ft"], ["--chameleon-ft-strategy", "reroute"],
                                    ["--chameleon-ft-strategy", "sideways"],
                                    ["--chameleon-ft-heartbeat-s", "0"],
                                    ["--chameleon-ft-shard-replica-interval", "-3"]]),
                   max_size=3))
@FUZZ
def test_any_fault_specs_run_or_end_in_one_line(specs, world, ft):
    argv = list(TINY)
    for spec in specs:
        argv += ["--chameleon-inject-fault", spec]
    for extra in ft:
        argv += extra
    with under_agent(True):
        outcome(lambda: checked_args(argv, world))


def _mutations(preset: dict) -> st.SearchStrategy[dict]:
    keys = [(section, key) for section, body in preset.items() if isinstance(body, dict)
            for key in body]
    value = st.sampled_from([None, -1, 0, 1, 3.5, "abc", True, [1, 2], {"x": 1}])

    @st.composite
    def mutate(draw) -> dict:
        out = {s: dict(b) if isinstance(b, dict) else b for s, b in preset.items()}
        for _ in range(draw(st.integers(1, 3))):
            choice = draw(st.sampled_from(["replace", "remove", "add", "section"]))
            if choice == "section":
                out[draw(st.sampled_from(["nope", "swap", "ft", "megatron"]))] = draw(value)
                continue
            section, key = draw(st.sampled_from(keys))
            if choice == "replace":
                out[section][key] = draw(value)
            elif choice == "remove":
                out[section].pop(key, None)
            else:
                out[section]["no_such_key"] = draw(value)
        return out

    return mutate()


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_any_mutated_preset_runs_or_ends_in_one_line(preset, tmp_path_factory):
    base = yaml.safe_load(preset.read_text())
    folder = tmp_path_factory.mktemp(preset.stem)

    @given(mutated=_mutations(base), world=st.sampled_from([1, 8]))
    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    def check(mutated, world):
        path = folder / "preset.yaml"
        path.write_text(yaml.safe_dump(mutated))
        with under_agent(True):
            outcome(lambda: checked_args(["--chameleon-config", str(path)], world))

    check()


@given(nproc=st.sampled_from(["-1", "0", "1", "2", "x", "auto"]),
       nnodes=st.sampled_from(["0", "1", "2", "0:2", "1:0", "2:1", "a:b", "1:4"]),
       ft=st.booleans())
@FUZZ
def test_any_process_counts_run_or_end_in_one_line(nproc, nnodes, ft):
    argv = ["--nproc-per-node", nproc, "--nnodes", nnodes, "-m", launcher.TRAINER, *TINY,
            *(["--chameleon-ft"] if ft else [])]
    with under_agent(False):
        outcome(lambda: launcher.checked_launch(argv))


def test_the_fuzzer_sees_real_errors():
    """The property is not vacuous: a known mistake is one line, a good run is ok."""
    assert outcome(lambda: checked_args(TINY, 1)) == "ok"
    line = outcome(lambda: checked_args(TINY + ["--num-layers", "0"], 1))
    assert line.startswith("chameleon-pretrain-gpt: error: ") and "--num-layers" in line
    line = outcome(lambda: launcher.checked_launch(["--nproc-per-node", "0", "x.py"]))
    assert line == "chameleon-run: error: --nproc-per-node=0: must be >= 1"
    assert isinstance(build_parser(), argparse.ArgumentParser)
