"""The CPU platform patches: applied only without CUDA, idempotent, reversible, versioned."""

import pytest
import torch

from chameleon_megatron.megatron import platform as plat

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches only apply without CUDA")
def test_apply_remove_restores_everything():
    from megatron.core.tensor_parallel import random as mrandom

    before = (torch.cuda.current_device, torch.cuda.synchronize, mrandom._get_cuda_rng_state,
              mrandom.CudaRNGStatesTracker.fork, torch.compile)
    t = torch.ones(3)
    type_before = t.type()  # another fixture's platform may already be active
    p = plat.CpuPlatform()
    assert p.apply() and p.apply()  # idempotent
    assert torch.cuda.current_device() == "cpu"
    f = lambda x: x + 1  # noqa: E731
    assert torch.compile(f) is f and torch.compile(mode="max-autotune")(f) is f
    assert torch.empty(2, device="cuda").device.type == "cpu"
    assert t.cuda() is t and t.type() == "torch.cuda.FloatTensor"
    assert t.to(torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    p.remove()
    p.remove()
    after = (torch.cuda.current_device, torch.cuda.synchronize, mrandom._get_cuda_rng_state,
             mrandom.CudaRNGStatesTracker.fork, torch.compile)
    assert after == before
    assert t.type() == type_before


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches only apply without CUDA")
def test_rng_tracker_forks_on_cpu_generator():
    from megatron.core.tensor_parallel import random as mrandom

    with plat.cpu_platform():
        tracker = mrandom.CudaRNGStatesTracker()
        tracker.add("tp", 123)
        torch.manual_seed(0)
        outside = torch.rand(1)
        torch.manual_seed(0)
        with tracker.fork("tp"):
            a = torch.rand(1)
        with tracker.fork("tp"):
            b = torch.rand(1)
        after = torch.rand(1)
        ref = torch.Generator().manual_seed(123)
        # The forked stream is seed 123's, continues across forks, and leaves the outer alone.
        assert torch.equal(a, torch.rand(1, generator=ref))
        assert torch.equal(b, torch.rand(1, generator=ref))
        assert torch.equal(after, outside)


def test_the_installed_call_sites_fit_and_a_changed_one_is_refused_by_name(monkeypatch):
    from megatron.core.tensor_parallel import random as mrandom

    plat.check_cpu_seams(mrandom)  # the installed megatron-core fits
    monkeypatch.setattr(plat, "version", lambda name: "9.9.9")

    def get_state(device="cuda", clone=False, stream=None):
        return None

    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", get_state)
    with pytest.raises(RuntimeError, match=r"megatron-core 9.9.9: tensor_parallel.random"
                                           r"._get_cuda_rng_state takes \['stream'\]"):
        plat.check_cpu_seams(mrandom)
    monkeypatch.delattr(mrandom.CudaRNGStatesTracker, "fork")
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda device="cuda": None)
    with pytest.raises(RuntimeError, match="CudaRNGStatesTracker.fork is missing"):
        plat.check_cpu_seams(mrandom)
