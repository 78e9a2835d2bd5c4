"""Fused kernels follow what is installed: a GPU without TransformerEngine (or whose TE
fails to load its libraries) builds megatron's local spec with settings it accepts."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import pytest
import torch

from chameleon_megatron.megatron.platform import cpu_platform
from chameleon_megatron.megatron.te_absent import TeAbsentPatch
from chameleon_megatron.training import model as model_lib
from chameleon_megatron.training.arguments import parse_args
from chameleon_megatron.training.validate import validate_args
from dist_utils import TINY

pytestmark = pytest.mark.timeout(120)


class BrokenTE(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An installed TransformerEngine whose shared libraries cannot load."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "transformer_engine":
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError("libtransformer_engine.so: cannot open shared object file")


@pytest.fixture
def gpu_without_te(monkeypatch):
    """CUDA "available", TransformerEngine installed but failing to load its libraries, and
    no fused softmax extensions."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "meta_path", [BrokenTE(), *sys.meta_path])
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_gpu_without_usable_te_gets_the_local_spec_and_no_persistent_norm(gpu_without_te,
                                                                          request):
    kernels = model_lib.available_kernels()
    assert kernels == model_lib.Kernels(transformer_engine=False, softmax=False, jit=True)
    te = TeAbsentPatch()
    assert te.apply()  # hides the broken TE from megatron's ImportError guards
    request.addfinalizer(te.remove)
    args = validate_args(parse_args([*TINY, "--train-iters", "1", "--use-cpu-initialization"]), 1)
    config = model_lib.transformer_config(args, kernels)
    assert not config.persist_layer_norm and not config.masked_softmax_fusion
    assert config.bias_dropout_fusion
    spec = model_lib.layer_spec(args, kernels)
    with cpu_platform(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)  # build the model on the CPU
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        from chameleon_megatron.megatron import groups

        ours = not parallel_state.model_parallel_is_initialized()  # (another test's, else)
        if ours:
            groups.init_from_launcher(rank=0, world_size=1, backend="gloo", timeout_s=30)
            groups.build_uniform(1, 1, timeout_s=30)
        try:
            gpt = GPTModel(config=config, transformer_layer_spec=spec,
                           vocab_size=args.padded_vocab_size,
                           max_sequence_length=args.max_position_embeddings)
            norms = {type(m).__name__ for m in gpt.modules() if "Norm" in type(m).__name__}
            assert norms and not any("TE" in n for n in norms)
        finally:
            if ours:
                groups.destroy()
    te.remove()
    assert "transformer_engine" not in sys.modules


def test_without_cuda_no_fused_kernel_is_asked_for() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine")
    kernels = model_lib.available_kernels()
    assert kernels == model_lib.Kernels(transformer_engine=False, softmax=False, jit=False)
