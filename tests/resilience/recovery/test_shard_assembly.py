"""Who rebuilds which units from the distributed optimizer's shard copies (pure parts of
``shard_assembly``), and the rebuilt units themselves."""

from __future__ import annotations

import base64

import pytest
import torch

from chameleon_megatron.resilience.dist_opt import Piece
from chameleon_megatron.resilience.recovery import shard_assembly as sa
from chameleon_megatron.resilience.recovery.host_copies import HostMover
from chameleon_megatron.resilience.recovery.run_state import RunState
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
    # every member of rank 0's group gets rank 0's copy from rank 2, the others' from their
    # owners, except the one it holds as its replica (rank 4 holds rank 2's: no transfer)
    assert sorted(m for m in sa.moves(h, 6) if m[2] in (2, 4)) == [
        (2, "replica", 2, 0), (2, "replica", 4, 0), (4, "own", 2, 4), (4, "replica", 4, 2)]
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
    for kind, built in (("params", params), ("optimizer", state)):  # what a sender checks
        assert units.specs(3, kind) == {n: (list(t.shape), str(t.dtype))
                                        for n, t in built.items()}
    assert units.tensors(3, "optimizer")["mlp.linear_fc1.weight/exp_avg"] is not \
        state["mlp.linear_fc1.weight/exp_avg"]  # built on each read, nothing kept


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


def with_run(h: dict, steps: dict[int, list[int]]) -> dict:
    """``h``'s members holding committed sets at ``steps[member]`` (each with its run state:
    consumed samples = 10 x step)."""
    out = {}
    for m, its in steps.items():
        out[m] = [{**held([m], it)[m][0],
                   "run": base64.b64encode(RunState(it, 10 * it).to_bytes()).decode()}
                  for it in its]
    return out


def test_the_step_every_holder_can_use_is_chosen_not_the_newest() -> None:
    """A failure while the copies of step 6 were in flight: ranks 1 and 2 committed them,
    ranks 3, 4, 5 did not (the older pair, of step 4, is still held by everyone). At step 6
    nobody holds the copies of ranks 3 and 4, so no group can be rebuilt: every member goes
    back to step 4, with the run state of its copies of step 4."""
    h = with_run({}, {1: [4, 6], 2: [4, 6], 3: [4], 4: [4], 5: [4]})
    assert sa.unassemblable(h, 6) == (1, 2, 3, 4, 5) and sa.unassemblable(h, 4) == ()
    assert sa.choose(h, [1, 2, 3, 4, 5]) == 4
    published = {1: RunState(6, 60, after_step="eval"), 2: RunState(6, 60),
                 3: RunState(4, 40, after_step="save"), 4: RunState(4, 40),
                 5: RunState(4, 40), 7: RunState(-1, 0)}  # 7: a spare
    states = sa.agreed_states(h, published)
    assert {m: (s.iteration, s.consumed_samples) for m, s in states.items()} == {
        1: (4, 40), 2: (4, 40), 3: (4, 40), 4: (4, 40), 5: (4, 40), 7: (-1, 0)}
    assert states[3].after_step == "save"  # a state of that very step is kept as published
    # everyone committed step 6: it is used
    h = with_run({}, {m: [4, 6] for m in (1, 2, 3, 4, 5)})
    assert sa.choose(h, [1, 2, 3, 4, 5]) == 6
    # two neighbours dead at every step: the newest, the others stale (checkpoint)
    h = with_run({}, {m: [4, 6] for m in (1, 3, 4, 5)})
    assert sa.choose(h, [1, 3, 4, 5]) == 6 and sa.unassemblable(h, 6) == (4,)
