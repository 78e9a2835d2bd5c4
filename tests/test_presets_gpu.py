"""Presets in configs/ load and validate; GPU presets are real shapes that fit their layout;
the torchrun launchers in scripts/ start the right processes with a preset.

The layout and memory checks are first-order arithmetic written here (the oracle), not the
trainer's validation. With CHAMELEON_MEGATRON_LM=/path/to/Megatron-LM (its Python deps
importable), the flag table and every GPU preset are also checked by Megatron-LM's parser.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from chameleon_megatron.config import build_config, read_yaml

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "configs").glob("*.yaml"))
GPU_NAME = re.compile(r"-(?P<size>\d+(?:\.\d+)?)b-(?P<gpus>\d+)x(?:h100|h200)\.yaml$")
GPU_PRESETS = [p for p in PRESETS if GPU_NAME.search(p.name)]
H100_BYTES = 80e9

# Megatron-LM argument dest names a preset may set, with their value types (checked against
# Megatron-LM's own parser by test_flag_table_matches_megatron_lm when a checkout is given).
KNOWN: dict[str, type] = {
    "num_layers": int, "hidden_size": int, "ffn_hidden_size": int, "num_attention_heads": int,
    "group_query_attention": bool, "num_query_groups": int, "kv_channels": int,
    "seq_length": int, "max_position_embeddings": int, "vocab_size": int,
    "make_vocab_size_divisible_by": int, "position_embedding_type": str, "rotary_base": int,
    "normalization": str, "swiglu": bool, "add_bias_linear": bool,
    "untie_embeddings_and_output_weights": bool, "hidden_dropout": float,
    "attention_dropout": float, "init_method_std": float, "micro_batch_size": int,
    "global_batch_size": int, "train_iters": int, "lr": float, "min_lr": float,
    "lr_decay_style": str, "lr_decay_iters": int, "lr_warmup_iters": int,
    "weight_decay": float, "clip_grad": float, "adam_beta1": float, "adam_beta2": float,
    "adam_eps": float, "use_distributed_optimizer": bool, "overlap_grad_reduce": bool,
    "bf16": bool, "recompute_granularity": str, "recompute_method": str,
    "recompute_num_layers": int, "seed": int, "tensor_model_parallel_size": int,
    "pipeline_model_parallel_size": int, "num_layers_per_virtual_pipeline_stage": int,
    "sequence_parallel": bool, "distributed_backend": str, "distributed_timeout_minutes": int,
    "mock_data": bool, "split": str, "log_interval": int, "eval_interval": int,
    "eval_iters": int, "save_interval": int,
}
CHOICES: dict[str, set[str]] = {
    "position_embedding_type": {"learned_absolute", "rope"},
    "normalization": {"LayerNorm", "RMSNorm"},
    "lr_decay_style": {"constant", "linear", "cosine", "inverse-square-root", "WSD"},
    "recompute_granularity": {"full", "selective"},
    "recompute_method": {"uniform", "block"},
    "distributed_backend": {"nccl", "gloo"},
}


def megatron_section(path: Path) -> dict:
    return read_yaml(path).get("megatron") or {}


def type_problems(section: dict) -> list[str]:
    problems = []
    for key, value in section.items():
        want = KNOWN.get(key)
        if want is None:
            problems.append(f"unknown key megatron.{key}")
        elif want is float and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            problems.append(f"megatron.{key}={value!r}: not a number")
        elif want is not float and type(value) is not want:
            problems.append(f"megatron.{key}={value!r}: not {want.__name__}")
        elif key in CHOICES and value not in CHOICES[key]:
            problems.append(f"megatron.{key}={value!r}: not one of {sorted(CHOICES[key])}")
    return problems


def layout_problems(m: dict, world: int | None) -> list[str]:
    """What stops the preset's layout from working on ``world`` ranks (None: skip batch checks)."""
    tp = m.get("tensor_model_parallel_size", 1)
    pp = m.get("pipeline_model_parallel_size", 1)
    layers, heads = m["num_layers"], m["num_attention_heads"]
    chunk = m.get("num_layers_per_virtual_pipeline_stage")
    problems = []
    if heads % tp:
        problems.append(f"heads {heads} not divisible by TP {tp}")
    if m["hidden_size"] % heads:
        problems.append(f"hidden {m['hidden_size']} not divisible by heads {heads}")
    if layers % pp:
        problems.append(f"layers {layers} not divisible by PP {pp}")
    elif chunk and (layers // pp) % chunk:
        problems.append(f"{layers // pp} layers per stage not divisible by VPP chunk {chunk}")
    if m["seq_length"] > m.get("max_position_embeddings", m["seq_length"]):
        problems.append("seq_length exceeds max_position_embeddings")
    if world is None:
        return problems
    if world % (tp * pp):
        return problems + [f"world {world} not divisible by TP x PP = {tp * pp}"]
    dp = world // (tp * pp)
    per_step = m["micro_batch_size"] * dp
    if m["global_batch_size"] % per_step:
        problems.append(f"global batch {m['global_batch_size']} not divisible by micro x DP = {per_step}")
    elif chunk and (m["global_batch_size"] // per_step) % pp:
        problems.append(f"interleaving needs microbatches ({m['global_batch_size'] // per_step}) "
                        f"divisible by PP {pp}")
    return problems


def parameters(m: dict) -> int:
    """Parameter count of a GPT/Llama decoder with multi-head attention (biases and norms,
    under 0.1%, left out)."""
    h, ffn = m["hidden_size"], m.get("ffn_hidden_size", 4 * m["hidden_size"])
    per_layer = 4 * h * h + (3 if m.get("swiglu") else 2) * h * ffn
    embeddings = m["vocab_size"] * h * (2 if m.get("untie_embeddings_and_output_weights") else 1)
    if m.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        embeddings += m["max_position_embeddings"] * h
    return m["num_layers"] * per_layer + embeddings


def memory_per_gpu(m: dict, world: int) -> float:
    """Bytes on the busiest GPU: bf16 weights, fp32 main grads, fp32 master weights and Adam
    moments sharded over DP, plus the first stage's in-flight activations with fused
    attention (s*b*h*(10 + 24/TP) bytes per layer, no sequence parallelism)."""
    tp = m.get("tensor_model_parallel_size", 1)
    pp = m.get("pipeline_model_parallel_size", 1)
    dp = world // (tp * pp)
    state = parameters(m) / (tp * pp) * (2 + 4 + 12 / dp)
    per_layer = m["seq_length"] * m["micro_batch_size"] * m["hidden_size"] * (10 + 24 / tp)
    chunk = m.get("num_layers_per_virtual_pipeline_stage")
    if chunk:  # interleaved 1F1B: warm-up chunks of the first rank, plus the one in flight
        vpp = m["num_layers"] // (pp * chunk)
        layers_in_flight = chunk * ((pp - 1) * 2 + (vpp - 1) * pp + 1)
    else:  # 1F1B keeps PP microbatches of one stage (layers / PP each): all layers' worth
        layers_in_flight = m["num_layers"]
    return state + per_layer * layers_in_flight


# --------------------------------------------------------------------------- presets

def test_the_gpu_presets_exist():
    assert {p.name for p in GPU_PRESETS} >= {
        "gpt-1.3b-8xh100.yaml", "gpt-7b-8xh100.yaml", "llama-13b-8xh100.yaml"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_loads_and_validates(path):
    data = read_yaml(path)
    build_config(data)  # chameleon sections: unknown keys and bad values raise
    section = megatron_section(path)
    assert type_problems(section) == []
    assert layout_problems(section, world=None) == []


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: p.name)
def test_gpu_preset_is_a_real_shape_that_fits(path):
    m = megatron_section(path)
    match = GPU_NAME.search(path.name)
    world = int(match["gpus"])
    assert layout_problems(m, world) == []
    assert m.get("bf16") is True and m.get("distributed_backend") == "nccl"
    assert parameters(m) == pytest.approx(float(match["size"]) * 1e9, rel=0.10)
    assert memory_per_gpu(m, world) < 0.9 * H100_BYTES


def test_oracles_catch_bad_presets():
    good = megatron_section(REPO / "configs" / "llama-13b-8xh100.yaml")
    assert layout_problems(good, 8) == []
    cases = {
        "heads 10 not divisible by TP 4": {"num_attention_heads": 10, "tensor_model_parallel_size": 4},
        "layers 41 not divisible by PP 2": {"num_layers": 41, "num_layers_per_virtual_pipeline_stage": None},
        "20 layers per stage not divisible by VPP chunk 8": {"num_layers_per_virtual_pipeline_stage": 8},
        "global batch 100 not divisible by micro x DP = 8": {"global_batch_size": 100, "micro_batch_size": 4},
        "world 8 not divisible by TP x PP = 16": {"tensor_model_parallel_size": 8},
        "interleaving needs microbatches (63) divisible by PP 2": {"global_batch_size": 126},
    }
    for expected, change in cases.items():
        assert layout_problems({**good, **change}, 8) == [expected]
    assert type_problems({"num_layerz": 4, "lr": "fast", "bf16": 1, "normalization": "BatchNorm"}) == [
        "unknown key megatron.num_layerz",
        "megatron.lr='fast': not a number",
        "megatron.bf16=1: not bool",
        "megatron.normalization='BatchNorm': not one of ['LayerNorm', 'RMSNorm']",
    ]
    # Llama-2-7B by hand: 32 x (4 x 4096^2 + 3 x 4096 x 11008) + 2 x 32000 x 4096.
    seven = megatron_section(REPO / "configs" / "gpt-7b-8xh100.yaml")
    assert parameters(seven) == 6_738_149_376
    # Without tensor and pipeline parallelism the 13B model does not fit an 80 GB GPU.
    flat = {**good, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "num_layers_per_virtual_pipeline_stage": None}
    assert memory_per_gpu(flat, 8) > H100_BYTES


# --------------------------------------------------------------------------- launchers

FAKE_ENTRY = '''\
import json, os, sys
with open(os.path.join(os.environ["OUT_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:],
               "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
               "alloc": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}, f)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launchers(commands: list[tuple[list[str], dict]], tmp_path: Path) -> list[dict]:
    """Start (arguments, extra env) launcher commands together, a fake entry recording each
    rank; the ranks' records."""
    (tmp_path / "entry.py").write_text(FAKE_ENTRY)
    env = {**os.environ, "PYTHON": sys.executable, "OUT_DIR": str(tmp_path),
           "CHAMELEON_ENTRY": str(tmp_path / "entry.py")}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    procs = [subprocess.Popen(["bash", str(REPO / "scripts" / argv[0]), *argv[1:]], cwd=REPO,
                              env={**env, **extra}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for argv, extra in commands]
    try:
        logs = [p.communicate(timeout=100)[0] for p in procs]
    finally:  # torchrun's workers go with their launcher
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert [p.returncode for p in procs] == [0] * len(procs), logs
    return [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]


def test_cpu_launcher_runs_n_gloo_ranks_with_preset_and_flags(tmp_path):
    ranks = run_launchers([(["launch_cpu.sh", "2", "configs/tiny-cpu.yaml",
                             "--train-iters", "3"], {})], tmp_path)
    assert ranks == [{"world": "2", "max_connections": None, "alloc": None, "argv": [
        "--chameleon-config", "configs/tiny-cpu.yaml", "--distributed-backend", "gloo",
        "--train-iters", "3"]}] * 2


def test_gpu_launcher_uses_nccl(tmp_path):
    ranks = run_launchers([(["launch_gpu.sh", "1", "configs/gpt-7b-8xh100.yaml",
                             "--mock-data"], {})], tmp_path)
    assert ranks == [{"world": "1", "max_connections": "1",
                      "alloc": "expandable_segments:True", "argv": [
        "--chameleon-config", "configs/gpt-7b-8xh100.yaml", "--distributed-backend", "nccl",
        "--mock-data"]}]


def test_multinode_launcher_rendezvous_of_two_nodes(tmp_path):
    node = {"NNODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "RDZV_ID": "test",
            "BACKEND": "gloo"}
    argv = ["launch_multinode.sh", "1", "configs/tiny-cpu.yaml", "--seed", "7"]
    ranks = run_launchers([(argv, {**node, "NODE_RANK": str(r)}) for r in (0, 1)], tmp_path)
    assert ranks == [{"world": "2", "max_connections": None, "alloc": None, "argv": [
        "--chameleon-config", "configs/tiny-cpu.yaml", "--distributed-backend", "gloo",
        "--seed", "7"]}] * 2


def test_launchers_refuse_bad_arguments():
    def refused(script: str, *args: str, **env: str) -> str:
        done = subprocess.run(["bash", str(REPO / "scripts" / script), *args], cwd=REPO,
                              env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 2
        return done.stderr

    for script in ("launch_cpu.sh", "launch_gpu.sh", "launch_multinode.sh"):
        assert "usage:" in refused(script, "4", "no-such.yaml")
        assert "usage:" in refused(script, "configs/tiny-cpu.yaml")
    assert "set NNODES, NODE_RANK and RDZV_ENDPOINT" in refused(
        "launch_multinode.sh", "1", "configs/tiny-cpu.yaml", NNODES="2")
    assert "RDZV_ENDPOINT=host0: must be HOST:PORT" in refused(
        "launch_multinode.sh", "1", "configs/tiny-cpu.yaml", NNODES="2", NODE_RANK="0",
        RDZV_ENDPOINT="host0")


# ----------------------------------------------------------- a real Megatron-LM checkout

REAL = os.environ.get("CHAMELEON_MEGATRON_LM")
needs_real = pytest.mark.skipif(not REAL, reason="set CHAMELEON_MEGATRON_LM to a Megatron-LM checkout")

PARSER_DUMP = '''\
import argparse, json
from megatron.training.arguments import add_megatron_arguments
parser = add_megatron_arguments(argparse.ArgumentParser())
print(json.dumps({a.dest: [type(a).__name__, getattr(a.type, "__name__", None),
                           [str(c) for c in a.choices] if a.choices else None]
                  for a in parser._actions}))
'''

# Megatron-LM's validate_args asks the GPU's compute capability; answer 9 (Hopper).
VALIDATE = '''\
import sys, types
import torch
torch.cuda.get_device_properties = lambda *a: types.SimpleNamespace(major=9)
from megatron.training.arguments import parse_args, validate_args
sys.argv = ["pretrain_gpt.py", "--chameleon-config", sys.argv[1], "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--transformer-impl", "local"]
from chameleon_megatron.megatron_lm import extra_args_provider
args = validate_args(parse_args(extra_args_provider), {})
print("LAYOUT", args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
      args.virtual_pipeline_model_parallel_size, args.data_parallel_size)
'''


def real_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [REAL, str(REPO), os.environ.get("PYTHONPATH", "")])}


@needs_real
@pytest.mark.timeout(300)
def test_flag_table_matches_megatron_lm():
    out = subprocess.run([sys.executable, "-c", PARSER_DUMP], env=real_env(), cwd=REAL,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    actions = json.loads(out.stdout.splitlines()[-1])
    for key, want in KNOWN.items():
        kind, type_name, choices = actions[key]
        if want is bool:
            assert kind in ("_StoreTrueAction", "_StoreFalseAction"), key
        elif key != "distributed_backend":  # a plain string option there
            assert type_name == want.__name__, key
        if key in CHOICES:
            assert CHOICES[key] <= set(choices), key


@needs_real
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: p.name)
def test_megatron_lm_validates_gpu_preset(path):
    m = megatron_section(path)
    world = int(GPU_NAME.search(path.name)["gpus"])
    env = {**real_env(), "WORLD_SIZE": str(world), "RANK": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    out = subprocess.run([sys.executable, "-c", VALIDATE, str(path)], env=env, cwd=REAL,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    tp = m.get("tensor_model_parallel_size", 1)
    pp = m.get("pipeline_model_parallel_size", 1)
    chunk = m.get("num_layers_per_virtual_pipeline_stage")
    vpp = m["num_layers"] // (pp * chunk) if chunk else None
    assert f"LAYOUT {tp} {pp} {vpp} {world // (tp * pp)}" in out.stdout
