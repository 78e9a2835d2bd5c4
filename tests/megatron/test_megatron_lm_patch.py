"""patches/apply.py and chameleon_megatron.megatron_lm's argument plumbing, on a synthetic
checkout (``lm_support.make_checkout``): the text the patch writes, refusals, and the
Chameleon flags and presets of this path. The hook on a stand-in Megatron-LM:
``test_megatron_lm_standin.py``; on a real checkout: ``test_megatron_lm_real.py``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.config import add_chameleon_args, build_config
from chameleon_megatron import megatron_lm
from chameleon_megatron.resilience.store.env import AGENT_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_support import (  # noqa: E402
    REPO, SYNTHETIC_SCRIPT, make_checkout, patch, rename_train_model_parameter, script_bytes,
)

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- text level

def test_apply_inserts_block_at_top_of_main(tmp_path):
    ckpt = make_checkout(tmp_path)
    assert patch.status(ckpt) == "unpatched"
    assert patch.apply(ckpt) is True
    lines = script_bytes(ckpt).decode().splitlines()
    guard = lines.index('if __name__ == "__main__":')
    assert lines[guard + 1:guard + 6] == [
        "    # >>> chameleon-megatron (patches/apply.py) >>>",
        "    from chameleon_megatron.megatron_lm import wrap_pretrain as _chameleon_wrap",
        "    pretrain = _chameleon_wrap(pretrain)",
        "    # <<< chameleon-megatron <<<",
        "    # like Megatron-LM's in-process-restart wrapper, this parses the arguments first",
    ]
    assert patch.status(ckpt) == "patched"
    compile(script_bytes(ckpt), "pretrain_gpt.py", "exec")


def test_apply_is_idempotent_and_remove_restores_bytes(tmp_path):
    ckpt = make_checkout(tmp_path)
    original = script_bytes(ckpt)
    patch.apply(ckpt)
    once = script_bytes(ckpt)
    assert patch.apply(ckpt) is False
    assert script_bytes(ckpt) == once
    assert patch.remove(ckpt) is True
    assert script_bytes(ckpt) == original
    assert patch.remove(ckpt) is False
    assert script_bytes(ckpt) == original


def test_crlf_file_round_trips(tmp_path):
    ckpt = make_checkout(tmp_path, SYNTHETIC_SCRIPT.replace("\n", "\r\n"))
    original = script_bytes(ckpt)
    patch.apply(ckpt)
    patched = script_bytes(ckpt)
    assert patched.count(b"\r\n") == original.count(b"\r\n") + 4
    assert b"\n" not in patched.replace(b"\r\n", b"")
    patch.remove(ckpt)
    assert script_bytes(ckpt) == original


def test_outdated_block_is_refreshed(tmp_path):
    ckpt = make_checkout(tmp_path)
    patch.apply(ckpt)
    fresh = script_bytes(ckpt)
    older = fresh.replace(b"pretrain = _chameleon_wrap(pretrain)\n", b"")
    (ckpt / "pretrain_gpt.py").write_bytes(older)
    assert patch.status(ckpt) == "outdated"
    assert patch.apply(ckpt) is True
    assert script_bytes(ckpt) == fresh


@pytest.mark.parametrize(("minor", "layout"), [(15, "0.16"), (18, "0.19"), (20, "0.19")])
def test_a_checkout_with_known_seams_is_patched_whatever_its_version(tmp_path, minor, layout):
    """The checkout's layout decides, read from its source: 0.18 with 0.19's seams is
    patched (patches/apply.py imports nothing of it)."""
    ckpt = make_checkout(tmp_path, minor=minor, layout=layout)
    assert patch.check_layout(ckpt) == layout
    assert patch.apply(ckpt) is True


def test_a_checkout_with_unknown_seams_is_refused(tmp_path):
    ckpt = make_checkout(tmp_path)
    rename_train_model_parameter(ckpt)
    original = script_bytes(ckpt)
    with pytest.raises(patch.PatchError, match=r"^Megatron-LM 0\.16\.1: train\(forward_step_func, "
                                               r"models, .* does not start with \("
                                               r"forward_step_func, model, .* the 0\.16 layout"):
        patch.apply(ckpt)
    assert script_bytes(ckpt) == original
    shutil.rmtree(ckpt / "megatron")
    make_checkout(tmp_path, minor=16)
    (ckpt / "megatron" / "training" / "checkpointing.py").unlink()  # an import not followed
    with pytest.raises(patch.PatchError, match="has no training.save_checkpoint"):
        patch.apply(ckpt)
    (ckpt / "megatron" / "training" / "training.py").unlink()
    with pytest.raises(patch.PatchError, match="no megatron/training/training.py"):
        patch.apply(ckpt)


def test_missing_version_file_is_refused(tmp_path):
    ckpt = make_checkout(tmp_path)
    (ckpt / "megatron" / "core" / "package_info.py").unlink()
    with pytest.raises(patch.PatchError, match="no megatron/core/package_info.py"):
        patch.apply(ckpt)


NO_CALL = SYNTHETIC_SCRIPT.replace("    pretrain(\n", "    run(\n")


@pytest.mark.parametrize("script, message", [
    (NO_CALL, r"expected one line 'pretrain\(' .* found 0"),
    (SYNTHETIC_SCRIPT + "    pretrain(\n        None,\n    )\n", r"expected one line 'pretrain\(' .* found 2"),
    # a pretrain( call outside the __main__ block does not count
    (NO_CALL.replace("def forward_step", "def f():\n    pretrain(\n        None)\n\n\ndef forward_step"),
     r"expected one line 'pretrain\(' .* found 0"),
    (SYNTHETIC_SCRIPT.replace('if __name__ == "__main__":', "def main():"),
     r"expected one 'if __name__ == \"__main__\":' line, found 0"),
])
def test_unknown_layout_is_refused(tmp_path, script, message):
    ckpt = make_checkout(tmp_path, script)
    with pytest.raises(patch.PatchError, match=message):
        patch.apply(ckpt)
    assert script_bytes(ckpt) == script.encode()


def test_broken_markers_are_refused(tmp_path):
    ckpt = make_checkout(tmp_path)
    patch.apply(ckpt)
    text = script_bytes(ckpt).decode().replace("    # <<< chameleon-megatron <<<\n", "")
    (ckpt / "pretrain_gpt.py").write_text(text)
    with pytest.raises(patch.PatchError, match="found 1 begin and 0 end markers"):
        patch.remove(ckpt)


def test_cli_exit_codes_and_diff(tmp_path):
    ckpt = make_checkout(tmp_path / "ok")
    run = [sys.executable, str(REPO / "patches" / "apply.py")]
    diff = subprocess.run(run + ["diff", str(ckpt)], capture_output=True, text=True, check=True)
    assert "+    pretrain = _chameleon_wrap(pretrain)" in diff.stdout
    assert patch.status(ckpt) == "unpatched"
    done = subprocess.run(run + ["apply", str(ckpt)], capture_output=True, text=True)
    assert done.returncode == 0 and "patched" in done.stdout
    bad = make_checkout(tmp_path / "bad")
    rename_train_model_parameter(bad)
    refused = subprocess.run(run + ["apply", str(bad)], capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: Megatron-LM 0.16.1: train(forward_step_func, models")


# ----------------------------------------------------------------- argument plumbing

def test_preset_megatron_section_becomes_defaults_and_cli_wins(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("megatron:\n  num_layers: 3\n  hidden_size: 64\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    argv = ["--chameleon-config", str(preset), "--hidden-size", "128"]
    megatron_lm.apply_preset_defaults(parser, argv)
    add_chameleon_args(parser)
    args = parser.parse_args(argv)
    assert (args.num_layers, args.hidden_size) == (3, 128)


def test_preset_unknown_megatron_key_is_refused(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("megatron:\n  num_layers: 3\n  num_layerz: 4\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int)
    with pytest.raises(ConfigError, match="unknown key megatron.num_layerz"):
        megatron_lm.apply_preset_defaults(parser, ["--chameleon-config", str(preset)])


def test_chain_providers_keeps_order_and_skips_none():
    def first(p):
        p.add_argument("--a", default="first")
        return p

    def second(p):
        p.set_defaults(a="second")
        return p

    parser = megatron_lm.chain_providers(None, first, second)(argparse.ArgumentParser())
    assert parser.parse_args([]).a == "second"


MARGS = argparse.Namespace(num_layers_per_virtual_pipeline_stage=None, rampup_batch_size=None,
                           use_distributed_optimizer=False, optimizer="adam",
                           expert_model_parallel_size=1, train_iters=10)


def test_plugins_follow_the_config(monkeypatch):
    assert megatron_lm.plugins_for(build_config({})) == []
    swap = megatron_lm.plugins_for(build_config({"swap": {"enabled": True}}))
    assert [type(p).__name__ for p in swap] == ["SwapPlugin"]
    ft = megatron_lm.plugins_for(build_config({"ft": {"enabled": True}}))
    assert [type(p).__name__ for p in ft] == ["ResiliencePlugin"]
    megatron_lm.check_supported(build_config({"swap": {"enabled": True}}), MARGS)
    with pytest.raises(ConfigError, match="needs the chameleon-run launcher"):
        megatron_lm.check_supported(build_config({"ft": {"enabled": True}}), MARGS)
    monkeypatch.setenv(AGENT_ENV, "1")
    megatron_lm.check_supported(build_config({"ft": {"enabled": True}}), MARGS)
    reroute = build_config({"ft": {"enabled": True, "strategy": "reroute"}})
    megatron_lm.check_supported(reroute, MARGS)  # rerouting runs (training.lm_plan)


@pytest.mark.parametrize("ft, margs, message", [
    ({}, {"rampup_batch_size": [8, 8, 100]}, "--chameleon-ft: --rampup-batch-size"),
    ({}, {"num_layers_per_virtual_pipeline_stage": 1}, "interleaved pipelines"),
    ({}, {"num_virtual_stages_per_pipeline_rank": 2}, "interleaved pipelines"),
    ({}, {"optimizer_cpu_offload": True}, "--chameleon-ft: --optimizer-cpu-offload: megatron's "
     "HybridDeviceOptimizer"),
    # what groups.build_uniform / LMLoop.rebuild do not rebuild
    ({}, {"context_parallel_size": 2}, "--chameleon-ft: --context-parallel-size 2: recovery "
     "rebuilds tensor, pipeline and data parallelism only"),
    ({}, {"expert_model_parallel_size": 2}, "--chameleon-ft: --expert-model-parallel-size 2: "
     "recovery rebuilds expert parallelism 1 only"),
    ({}, {"use_distributed_optimizer": True, "expert_model_parallel_size": 2},
     "--chameleon-ft: --expert-model-parallel-size 2"),
    ({}, {"expert_tensor_parallel_size": 2}, "--chameleon-ft: --expert-tensor-parallel-size 2 "
     "with --tensor-model-parallel-size 1: recovery rebuilds expert tensor parallelism at the "
     "TP degree only"),
    ({}, {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
     "--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2"),
    ({}, {"use_tp_pp_dp_mapping": True}, "--chameleon-ft: --use-tp-pp-dp-mapping"),
    ({}, {"decoder_first_pipeline_num_layers": 1},
     "--chameleon-ft: --decoder-first-pipeline-num-layers: uneven pipeline stages"),
    ({}, {"decoder_last_pipeline_num_layers": 1},
     "--chameleon-ft: --decoder-last-pipeline-num-layers: uneven pipeline stages"),
    ({}, {"pipeline_model_parallel_layout": "Et|tL"},
     "--chameleon-ft: --pipeline-model-parallel-layout: uneven pipeline stages"),
    ({}, {"num_distributed_optimizer_instances": 2},
     "--chameleon-ft: --num-distributed-optimizer-instances 2"),
    ({}, {"use_torch_fsdp2": True}, "--chameleon-ft: --use-torch-fsdp2: FSDP shards"),
    ({}, {"use_megatron_fsdp": True}, "--chameleon-ft: --use-megatron-fsdp: FSDP shards"),
    ({}, {"use_custom_fsdp": True}, "--chameleon-ft: --use-custom-fsdp: FSDP shards"),
    ({}, {"fp16": True}, "--chameleon-ft: --fp16: the loss scaler's state"),
    ({}, {"moe_router_enable_expert_bias": True, "use_distributed_optimizer": True},
     "--chameleon-ft: --moe-router-enable-expert-bias with --use-distributed-optimizer"),
    ({}, {"ckpt_format": "torch"}, "--chameleon-ft: --ckpt-format torch"),
    ({}, {"async_save": True}, "--chameleon-ft: --async-save"),
    ({}, {"non_persistent_ckpt_type": "local"},
     "--chameleon-ft: --non-persistent-ckpt-type local"),
])
def test_what_recovery_cannot_run_on_this_path_is_refused(monkeypatch, ft, margs, message):
    monkeypatch.setenv(AGENT_ENV, "1")
    with pytest.raises(ConfigError, match=re.escape(message)):
        megatron_lm.check_supported(build_config({"ft": {"enabled": True, **ft}}),
                                    argparse.Namespace(**{**vars(MARGS), **margs}))
    # only recovery is concerned: the same settings without --chameleon-ft pass
    megatron_lm.check_supported(build_config({}), argparse.Namespace(**{**vars(MARGS), **margs}))


@pytest.mark.parametrize("margs", [
    {"expert_tensor_parallel_size": None}, {"expert_tensor_parallel_size": 1},
    {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2},
    {"ckpt_format": "torch_dist", "non_persistent_ckpt_type": "global",
     "num_distributed_optimizer_instances": 1, "context_parallel_size": 1},
    {"moe_router_enable_expert_bias": True},  # the buffer moves with its layer
])
def test_what_recovery_rebuilds_is_accepted(monkeypatch, margs):
    monkeypatch.setenv(AGENT_ENV, "1")
    megatron_lm.check_supported(build_config({"ft": {"enabled": True}}),
                                argparse.Namespace(**{**vars(MARGS), **margs}))


@pytest.mark.parametrize("margs, flag", [
    ({"cpu_offloading_num_layers": 1}, "--cpu-offloading-num-layers 1"),
    ({"fine_grained_activation_offloading": True}, "--fine-grained-activation-offloading"),
])
def test_swap_with_megatrons_activation_offloading_is_refused(margs, flag):
    settings = argparse.Namespace(**{**vars(MARGS), **margs})
    with pytest.raises(ConfigError, match=re.escape(
            f"--chameleon-swap with {flag}: Megatron's activation offloading and Chameleon's "
            "swap would both own the saved-tensor hooks")):
        megatron_lm.check_supported(build_config({"swap": {"enabled": True}}), settings)
    megatron_lm.check_supported(build_config({}), settings)  # either alone is fine


def test_megatron_lms_yaml_arguments_are_refused(capsys):
    """--yaml-cfg makes Megatron-LM return its file's arguments and drop the command line's,
    --chameleon-* included, and cannot start a GPT job (test_megatron_lm_yaml.py): one line
    and exit 2, not a run without them or a traceback from Megatron-LM."""
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        return types.SimpleNamespace(yaml_cfg="gpt.yaml", num_layers=2)

    with pytest.raises(SystemExit) as exit_:
        megatron_lm.with_chameleon_args(parse_args)()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "pretrain_gpt.py: error: --yaml-cfg gpt.yaml: Megatron-LM's YAML arguments cannot "
        "start pretrain_gpt.py in this release and would replace every command-line flag, "
        "--chameleon-* included; give Megatron-LM's arguments as flags, or in the megatron "
        "section of a --chameleon-config preset"]
