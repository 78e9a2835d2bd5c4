"""Profile JSON schema, model-shape arithmetic, profile derivation."""

import json

import pytest
from dc_helpers import cost, make_profile

from chameleon_megatron.resilience.decision.model_shape import ModelShape
from chameleon_megatron.resilience.decision.profile import (
    FORMAT, load_profile, profile_from_dict, profile_to_dict, save_profile,
)
from chameleon_megatron.resilience.decision.shape_profile import Hardware, profile_from_shape

pytestmark = pytest.mark.timeout(60)


def test_round_trip_compacts_identical_layers(tmp_path):
    prof = make_profile(layers=[cost(), cost(), cost(f=3.0)])
    data = profile_to_dict(prof)
    assert [run["repeat"] for run in data["layers"]] == [2, 1]
    save_profile(prof, tmp_path / "p.json", model={"num_layers": 3})
    assert load_profile(tmp_path / "p.json") == prof
    assert json.loads((tmp_path / "p.json").read_text())["model"] == {"num_layers": 3}


def _valid() -> dict:
    return profile_to_dict(make_profile(2))


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d.update(colour=1), "unknown profile key 'colour'"),
    (lambda d: d.pop("device_memory_bytes"), "missing key 'device_memory_bytes'"),
    (lambda d: d["layers"][0].pop("forward_s"), "missing keys \\['forward_s'\\]"),
    (lambda d: d["layers"][0].update(backward_s=-1), "backward_s=-1"),
    (lambda d: d.update(global_batch_size=7, micro_batch_size=2), "not a multiple"),
    (lambda d: d.update(p2p_bandwidth_Bps=0), "p2p_bandwidth_Bps=0"),
])
def test_invalid_profiles_name_the_problem(edit, match):
    data = _valid()
    edit(data)
    with pytest.raises(ValueError, match=match):
        profile_from_dict(data)


def test_format_constant_is_written():
    assert _valid()["format"] == FORMAT


GPT = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
           micro_batch_size=2, global_batch_size=8, padded_vocab_size=100)


def test_gpt_layer_params_and_flops_by_hand():
    h, s, b, V = 64, 32, 2, 100
    shape = ModelShape.from_args(GPT)
    assert shape.layer_params() == 12 * h * h + 13 * h
    assert shape.layer_flops() == 24 * b * s * h * h + 4 * b * s * s * h
    assert shape.output_flops() == 2 * b * s * h * V
    assert shape.embedding_params() == (V + s) * h
    swiglu = ModelShape.from_args({**GPT, "swiglu": True, "ffn_hidden_size": 96,
                                   "add_bias_linear": False, "normalization": "RMSNorm"})
    assert swiglu.layer_params() == 4 * h * h + 3 * h * 96 + 2 * h


def test_activation_bytes_follow_the_standard_breakdown():
    h, s, b, a = 64, 32, 2, 4
    sbh = s * b * h
    plain = ModelShape.from_args(GPT)
    assert plain.layer_activation_bytes() == sbh * (34 + 5 * a * s / h)
    tp = ModelShape.from_args({**GPT, "tensor_model_parallel_size": 4})
    assert tp.layer_activation_bytes() == pytest.approx(sbh * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    sp = ModelShape.from_args({**GPT, "tensor_model_parallel_size": 4, "sequence_parallel": True})
    assert sp.layer_activation_bytes() == pytest.approx(sbh * (34 / 4 + 5 * a * s / (h * 4)))
    flash = ModelShape.from_args({**GPT, "use_flash_attn": True})
    assert flash.layer_activation_bytes() == sbh * 34


def test_missing_args_are_named():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_args({k: v for k, v in GPT.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="vocab_size"):
        ModelShape.from_args({k: v for k, v in GPT.items() if k != "padded_vocab_size"})


def test_profile_from_shape_per_rank_figures():
    shape = ModelShape.from_args({**GPT, "tensor_model_parallel_size": 2, "bf16": True})
    hw = Hardware(device_memory_bytes=1e9, p2p_bandwidth_Bps=1e9, allreduce_bandwidth_Bps=1e9,
                  transfer_bandwidth_Bps=1e9)
    prof = profile_from_shape(shape, hw, seconds_per_flop=1e-12, name="t", source="test")
    layer = prof.layers[0]
    assert layer.forward_s == pytest.approx(shape.layer_flops() / 2 * 1e-12)
    assert layer.backward_s == pytest.approx(2 * layer.forward_s)
    assert layer.param_bytes == shape.layer_params() / 2 * 2
    assert layer.optimizer_bytes == shape.layer_params() / 2 * 12
    assert prof.global_microbatches == 4 and prof.num_layers == 2
