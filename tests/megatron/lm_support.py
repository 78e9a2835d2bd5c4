"""Shared by the Megatron-LM tests: patches/apply.py loaded as a module, a synthetic
checkout (a ``pretrain_gpt.py`` holding only the lines the patch keys on), and copies of a
real checkout (CHAMELEON_MEGATRON_LM, else ../shared/megatron-lm next to the repository, as
on CI)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
from pathlib import Path

import pytest

from chameleon_megatron.megatron.lm_seams import LAYOUTS

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("chameleon_patch_apply",
                                               REPO / "patches" / "apply.py")
patch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(patch)


def script_bytes(checkout: Path) -> bytes:
    return (checkout / "pretrain_gpt.py").read_bytes()


SHARED = REPO.parent / "shared" / "megatron-lm"
REAL = os.environ.get("CHAMELEON_MEGATRON_LM") or (str(SHARED) if SHARED.is_dir() else None)
needs_real = pytest.mark.skipif(
    not REAL, reason="no Megatron-LM checkout: set CHAMELEON_MEGATRON_LM or put one next to the "
                     "repository (shared/megatron-lm)")


SHARED_019 = REPO.parent / "shared" / "megatron-lm-0.19"
REAL_019 = os.environ.get("CHAMELEON_MEGATRON_LM_019") or (
    str(SHARED_019) if SHARED_019.is_dir() else None)
"""Megatron-LM core_v0.19.0, the current release (Python >= 3.12)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_checkout(dest: Path, source: str | None = REAL) -> tuple[Path, dict]:
    """A writable copy of the real checkout (``source``) at ``dest`` (the original is never
    written), and the environment that imports its ``megatron`` and this repository."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    for path in [dest, *dest.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)  # the shared checkout is read-only
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(dest), str(REPO), os.environ.get("PYTHONPATH", "")])}
    return dest, env


SYNTHETIC_SCRIPT = '''\
"""Test stand-in for Megatron-LM's pretrain_gpt.py: only the lines the patch keys on."""
from megatron.training import maybe_wrap, pretrain


def forward_step(data_iterator, model):
    return None


if __name__ == "__main__":
    # like Megatron-LM's in-process-restart wrapper, this parses the arguments first
    pretrain, store = maybe_wrap(pretrain)

    pretrain(
        None,
        None,
        None,
        forward_step,
        extra_args_provider=None,
        store=store,
    )
'''

PACKAGE_INFO = "MAJOR = 0\nMINOR = {minor}\nPATCH = 1\nPRE_RELEASE = ''\n"


def make_checkout(root: Path, script: str = SYNTHETIC_SCRIPT, minor: int = 16,
                  layout: str = "0.16") -> Path:
    """A synthetic checkout: the script, the version file, and a training.py whose seams
    have ``layout`` (lm_seams.LAYOUTS; save_checkpoint imported, as Megatron-LM does)."""
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(PACKAGE_INFO.format(minor=minor))
    (root / "megatron" / "training").mkdir(parents=True)
    seams = dict(LAYOUTS[layout])
    saving = seams.pop("save_checkpoint")
    (root / "megatron" / "training" / "checkpointing.py").write_text(
        f"def save_checkpoint({', '.join(saving)}, **kwargs):\n    pass\n")
    (root / "megatron" / "training" / "training.py").write_text(
        "from .checkpointing import save_checkpoint\n\n" + "".join(
            f"\ndef {name}({', '.join(params)}, *args, **kwargs):\n    pass\n"
            for name, params in seams.items()))
    (root / "pretrain_gpt.py").write_bytes(script.encode())
    return root


def rename_train_model_parameter(ckpt: Path) -> None:
    """Change the checkout's ``train(forward_step_func, model, ...)`` to take ``models``: a
    seam whose signature no known layout has (however the definition is wrapped)."""
    training = ckpt / "megatron" / "training" / "training.py"
    text = training.read_text()
    old = re.compile(r"def train\((\s*)forward_step_func,(\s*)model,")
    assert len(old.findall(text)) == 1
    training.write_text(old.sub(r"def train(\1forward_step_func,\2models,", text))


DOUBLED_LOSS = '''
_megatron_forward_step = forward_step


def forward_step(data_iterator, model, return_schedule_plan=False):
    """A user's own loss: twice Megatron-LM's (its reported value too)."""
    output, loss = _megatron_forward_step(data_iterator, model)

    def doubled(output_tensor):
        total, tokens, report = loss(output_tensor)
        return 2 * total, tokens, {k: torch.cat([2 * v[:1], v[1:]]) for k, v in report.items()}
    return output, doubled


'''


def double_the_loss(ckpt: Path) -> None:
    """Give the checkout's pretrain_gpt.py a forward step of its own (``DOUBLED_LOSS``): a
    run that computed Megatron-LM's loss instead reports half its losses."""
    script = ckpt / "pretrain_gpt.py"
    text = script.read_text()
    main = 'if __name__ == "__main__":'
    assert text.count(main) == 1
    script.write_text(text.replace(main, DOUBLED_LOSS + main))
