"""chameleon_megatron.megatron.lm_seams: the run-time seam-layout check, and the
layout-dispatched rebuild call of setup_model_and_optimizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from chameleon_megatron.megatron.lm_seams import (
    LAYOUTS,
    UnsupportedMegatron,
    check_release,
    setup_for_rebuild,
)


def fake_training(key: str) -> tuple[SimpleNamespace, object]:
    """A training module and pretrain() whose functions take exactly the expected names."""
    fns = {}
    for name, params in LAYOUTS[key].items():
        namespace: dict = {}
        exec(f"def {name}({', '.join(params)}, *rest, **named): return ({', '.join(params)},)",
             namespace)
        fns[name] = namespace[name]
    return SimpleNamespace(**fns), fns["pretrain"]


@pytest.mark.parametrize("version, key", [("0.16.1", "0.16"), ("0.17.1", "0.16"),
                                          ("0.19.1rc0", "0.19"), ("0.18.2", "0.19"),
                                          ("0.20.0", "0.16")])
def test_a_release_with_a_known_layout_passes_whatever_its_version(version, key):
    """The seams decide, not a version list: 0.18 or a later release runs where every
    seam has a layout this project read."""
    training, pretrain = fake_training(key)
    assert check_release(version, training, pretrain) == key


def test_a_seam_of_another_release_is_refused():
    """0.19's pretrain() (config container first) under a 0.16 version: refused by name."""
    training, _ = fake_training("0.16")
    _, pretrain_019 = fake_training("0.19")
    with pytest.raises(UnsupportedMegatron, match=r"pretrain\(cfg_container, .*\) does not start "
                                                  r"with \(train_valid_test_dataset_provider, "):
        check_release("0.16.1", training, pretrain_019)


def test_a_missing_seam_is_refused():
    training, pretrain = fake_training("0.16")
    del training.train_step
    with pytest.raises(UnsupportedMegatron, match="has no training.train_step"):
        check_release("0.16.1", training, pretrain)


def test_rebuild_calls_each_release_in_its_own_order(monkeypatch):
    """0.16 takes (provider, type); 0.19 takes (type, provider) and a config container."""
    def setup_016(model_provider_func, model_type, checkpointing_context=None):
        return model_provider_func, model_type

    assert setup_for_rebuild(setup_016) is setup_016
    calls = []

    def setup_019(model_type, model_provider_func=None, checkpointing_context=None, *,
                  cfg_container=None, pg_collection=None):
        calls.append((model_type, model_provider_func, cfg_container))
        return "built"

    import sys
    import types

    modules = {
        "megatron.core.process_groups_config": types.SimpleNamespace(
            ProcessGroupCollection=types.SimpleNamespace(use_mpu_process_groups=lambda: "pgs")),
        "megatron.training": types.SimpleNamespace(get_args=lambda: "args"),
        "megatron.training.argument_utils": types.SimpleNamespace(
            gpt_config_from_args=lambda args: f"model({args})",
            pretrain_cfg_container_from_args=lambda args, model: f"container({args}, {model})"),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    assert setup_for_rebuild(setup_019)(None, "encoder_or_decoder") == "built"
    assert calls == [("encoder_or_decoder", None, "container(args, model(args))")]
