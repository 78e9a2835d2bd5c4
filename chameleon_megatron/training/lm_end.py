"""Megatron-LM's end-of-job work (its final checkpoint, its evaluations on the validation
and test sets) that the loop runs itself, inside its recovery, once ``train()`` is done;
pretrain() makes the same calls afterwards and each is then skipped once."""

from __future__ import annotations


class EndOfJobDone:
    """The end-of-job phases this loop ran that pretrain() has not called yet, in order."""

    def __init__(self) -> None:
        self._phases: list[str] = []
        self.returned = False
        """``train()`` returned to pretrain(): its later seam calls are its end-of-job work."""

    def ran(self, phase: str) -> None:
        if phase not in self._phases:  # once, though redone after a recovery
            self._phases.append(phase)

    def skips(self, phase: str) -> bool:
        """Whether pretrain()'s call of ``phase`` ("save" or "eval") after ``train()``
        returned is end-of-job work the loop has already done. pretrain() makes those calls
        in ``END_OF_JOB`` order under the same conditions; the iterators cannot tell its two
        evaluations apart (None on every tensor-parallel rank but the first)."""
        if not self.returned:
            return False
        wanted = ("final-save",) if phase == "save" else ("final-eval", "final-test")
        done = next((p for p in self._phases if p in wanted), None)
        if done is None:
            return False
        self._phases.remove(done)
        return True
