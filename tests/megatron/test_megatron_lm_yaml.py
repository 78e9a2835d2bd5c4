"""Why ``--yaml-cfg`` is refused on Megatron-LM's pretrain_gpt.py: Megatron-LM's own YAML
path cannot start a GPT job in this release, whatever the file says.

A YAML file equal to a working job's flags is written from Megatron-LM's own parser, with
``account_for_embedding_in_pipeline_split`` (a TransformerConfig field that
``validate_yaml`` also reads at the top level) in each place a file could put it; then
Megatron-LM's ``load_yaml``, ``validate_yaml`` and ``core_transformer_config_from_yaml`` run
as ``initialize_megatron`` and ``gpt_builder`` call them. Every placement fails inside
Megatron-LM. When a release fixes this, the test fails: then make
``megatron_lm.refuse_yaml_cfg`` let the file through and test a recovery with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_support import REAL, REPO, needs_real  # noqa: E402

pytestmark = [needs_real, pytest.mark.timeout(300)]

FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
         "--train-iters 6 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
         "--vocab-size 128 --bf16 --transformer-impl local").split()
KEY = "account_for_embedding_in_pipeline_split"
PROBE = '''
import dataclasses, enum, sys, yaml
placement, path, key = sys.argv[1:4]
sys.argv = ["pretrain_gpt.py", *sys.argv[4:]]
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer import TransformerConfig
from megatron.training.arguments import parse_args
from megatron.training.yaml_arguments import (
    core_transformer_config_from_yaml, load_yaml, validate_yaml)

def plain(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else None

flat = vars(parse_args())
parallel = {f.name for f in dataclasses.fields(ModelParallelConfig)}
model = {f.name for f in dataclasses.fields(TransformerConfig)}
data = {"model_parallel": {}, "language_model": {}}
for name in model - {key}:
    section = "model_parallel" if name in parallel else "language_model"
    data[section][name] = plain(flat.get(name))
data["language_model"].update(activation_func="gelu", init_method=None,
                              embedding_init_method=None)
data.update({k: plain(v) for k, v in flat.items() if k not in model})
if placement in ("top", "both"):
    data[key] = False
if placement in ("section", "both"):
    data["language_model"][key] = False
with open(path, "w") as f:
    yaml.safe_dump(data, f)
args = load_yaml(path)
args.rank, args.world_size = 0, 1
args = validate_yaml(args, {})
core_transformer_config_from_yaml(args, "language_model")
print("STARTED")
'''


PLACEMENTS = [
    ("top", f"Missing argument {KEY}"),        # the model's config lacks it
    ("section", f"no attribute '{KEY}'"),      # validate_yaml reads it at the top
    ("both", f"multiple values for keyword argument '{KEY}'"),  # validate_yaml's flattening
]
"""Where a file puts the key, and how Megatron-LM then fails."""


@pytest.mark.parametrize(("placement", "error"), PLACEMENTS)
def test_megatron_lms_yaml_path_cannot_start_a_gpt_job(tmp_path, placement, error):
    probe_yaml_path(REAL, tmp_path, placement, error)


def probe_yaml_path(checkout: str, tmp_path: Path, placement: str, error: str) -> None:
    """Megatron-LM's YAML path at ``checkout`` fails with ``error`` for ``placement``."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join([checkout, str(REPO)])}
    run = subprocess.run([sys.executable, "-c", PROBE, placement, str(tmp_path / "gpt.yaml"),
                          KEY, *FLAGS], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert "STARTED" not in run.stdout, (
        "Megatron-LM's --yaml-cfg now starts a GPT job: lift megatron_lm.refuse_yaml_cfg")
    assert run.returncode != 0 and error in run.stderr, run.stderr[-3000:]
