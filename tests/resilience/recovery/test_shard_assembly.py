"""Who rebuilds which units from the distributed optimizer's shard copies (pure parts of
``shard_assembly``), and the rebuilt units themselves."""

from __future__ import annotations

import pytest
import torch

from chameleon_megatron.resilience.dist_opt import Piece
from chameleon_megatron.resilience.recovery import shard_assembly as sa
from chameleon_megatron.resilience.recovery.host_copies import HostMover
from chameleon_megatron.resilience.recovery.shard_replica import ShardCopy

GROUPS = ((0, 2, 4), (1, 3, 5))
"""Two data-parallel groups of three (a DP3 x PP2 layout): the ring 0 -> 2 -> 4 -> 0."""


def meta(rank: int, iteration: int) -> dict:
    group = next(g for g in GROUPS if rank in g)
    return {"rank": rank, "group": list(group), "iteration": iteration, "pieces": [],
            "keys": [], "dtype": "torch.float32", "tied": False}


def held(alive: list[int], iteration: int = 6, stale: dict[int, int] | None = None) -> dict:
    """Each live rank's committed copies (one set): its own copy, and its predecessor's
    (the ring of its group)."""
    out = {}
    for r in alive:
        group = next(g for g in GROUPS if r in g)
        before = group[group.index(r) - 1]
        it = (stale or {}).get(r, iteration)
        out[r] = [{"own": meta(r, it), "replica": meta(before, it)}]
    return out


def test_a_dead_ranks_shard_comes_from_its_successor() -> None:
    h = held([1, 2, 3, 4, 5])
    assert sa.providers(h, 6)[0] == (2, "replica")
    assert sa.unassemblable(h, 6) == ()
    # every member of rank 0's group gets rank 0's copy from rank 2 and the others' own
    assert sorted(m for m in sa.moves(h, 6) if m[2] in (2, 4)) == [
        (2, "own", 4, 2), (2, "replica", 2, 0), (2, "replica", 4, 0), (4, "own", 2, 4)]
    assert sa.sources(h, 6, completed=6) == {"source": "shard copies", "iteration": 6,
                                             "rolled_back_steps": 0, "replicas_of": [0]}


def test_two_neighbours_dead_leave_their_group_without_a_shard() -> None:
    """Ranks 0 and 2 dead: rank 0's replica died with rank 2. Rank 4 cannot rebuild its
    units (stale: they fall back to the checkpoint); the other group still can."""
    h = held([1, 3, 4, 5])
    assert sa.unassemblable(h, 6) == (4,)
    assert all(dst != 4 for _, _, dst, _ in sa.moves(h, 6))


def test_copies_of_another_step_are_not_mixed() -> None:
    """Rank 3 did not commit step 6's copies: its own are not used; its shard at step 6
    comes from its successor's replica, so its group's other members still rebuild."""
    h = held([1, 2, 3, 4, 5], stale={3: 5})
    assert sa.unassemblable(h, 6) == (3,)
    assert sa.providers(h, 6)[3] == (5, "replica")
    h = held([1, 2, 3, 4], stale={3: 5})  # ... unless that successor is dead too
    assert sa.unassemblable(h, 6) == (1, 3)


def test_spares_hold_nothing_and_take_no_part() -> None:
    h = {**held([1, 2, 3, 4, 5]), 7: []}
    assert sa.unassemblable(h, 6) == () and all(7 not in m for m in sa.moves(h, 6))


def copy(rank: int, start: int, end: int, values: list[float], step: float,
         unit: int = 3) -> ShardCopy:
    piece = Piece(unit, "mlp.linear_fc1.weight", start, end, (2, 3))
    n = end - start
    data = HostMover().copy_out([
        ("0/main", torch.tensor(values[:n])), ("0/exp_avg", torch.tensor(values[:n]) * 10),
        ("0/step", torch.tensor(step))])
    return ShardCopy(rank=rank, group=(0, 1), iteration=6, pieces=(piece,),
                     keys=("exp_avg", "step"), dtype="torch.bfloat16", tied=False, data=data)


def test_units_are_rebuilt_from_the_pieces() -> None:
    units = sa.AssembledUnits([copy(0, 0, 4, [1, 2, 3, 4], 6.0), copy(1, 4, 6, [5, 6], 6.0)])
    params = units.tensors(3, "params")
    assert params["mlp.linear_fc1.weight/main"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert params["mlp.linear_fc1.weight"].dtype == torch.bfloat16
    state = units.tensors(3, "optimizer")
    assert state["mlp.linear_fc1.weight/exp_avg"].tolist() == [[10, 20, 30], [40, 50, 60]]
    assert state["mlp.linear_fc1.weight/step"].item() == 6.0


def test_a_missing_piece_is_an_error_not_zeros() -> None:
    with pytest.raises(ValueError, match="hold 4 of its 6 elements"):
        sa.AssembledUnits([copy(0, 0, 4, [1, 2, 3, 4], 6.0)])


def test_a_plan_rebuilds_only_its_own_units_and_each_piece_once() -> None:
    """In a plan a partner's copy also holds pieces of units this rank lacks (its other
    parts: partial, skipped), and the tied copy is whole on each holder (the same piece)."""
    whole = copy(0, 0, 6, [1, 2, 3, 4, 5, 6], 6.0)
    units = sa.AssembledUnits([whole, copy(1, 0, 6, [1, 2, 3, 4, 5, 6], 6.0),
                               copy(1, 0, 2, [7, 8], 6.0, unit=4)], keep=[3])
    assert units.units() == (3,)
    assert units.tensors(3, "params")["mlp.linear_fc1.weight/main"].tolist() == [
        [1, 2, 3], [4, 5, 6]]
    with pytest.raises(ValueError, match="hold 2 of its 6 elements"):
        sa.AssembledUnits([whole, copy(1, 0, 2, [7, 8], 6.0, unit=4)])
