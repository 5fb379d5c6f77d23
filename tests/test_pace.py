"""Replica groups rebalanced (infra.replicas.pace), as the groups run it: each group's numbers sent in the step's sum across
the quorum, and the same decision on every group from the sum. Groups simulated here: one GroupPace each, their reports
summed as torchft's all-reduce sums them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from infra.replicas.pace import GroupPace
from infra.shares import Seat

ARGS = dict(
    straggler_window_steps=2,
    straggler_min_samples=1,
    straggler_factor=1.5,
    straggler_patience=2,
    straggler_leave_factor=0.0,
    training_replicas=0,
    global_batch_size=16,
)


def groups(n: int, **args) -> list[GroupPace]:
    return [GroupPace(SimpleNamespace(**{**ARGS, **args}), processes=1) for _ in range(n)]


def step(paces: list[GroupPace], per_sample: list[float], quorum: int = 0, overhead: float = 0.01, commit: bool = True):
    """One try at a step on every group: each its seat, its samples timed at `per_sample` seconds each, the sum across the
    quorum; then committed (the decisions, one a group) or not."""
    seats = [pace.seat(Seat(rank=g, size=len(paces), id=quorum, healed_from=None, seconds=0.0)) for g, pace in enumerate(paces)]
    summed = sum(pace.report(len(paces)) for pace in paces)
    for pace in paces:
        pace.received(summed.clone())
    for g, pace in enumerate(paces):
        pace.measured(overhead + per_sample[g] * pace.samples())
    if not commit:
        for pace in paces:
            pace.not_committed()
        return seats, None
    return seats, [pace.committed(step.n) for pace in paces]


def run(paces, per_sample, steps, **kw):
    found = []
    for _ in range(steps):
        step.n += 1
        seats, decisions = step(paces, per_sample, **kw)
        found.append((seats, decisions))
    return found


def test_a_slow_group_gets_a_smaller_share_of_the_step_the_same_on_every_group_and_even_again_at_a_new_quorum():
    step.n = 0
    paces = groups(2)
    found = run(paces, [0.001, 0.003], 6)  # group 1 three times as slow a sample
    assert found[0][0][0].shares is None  # even until a window has measured both
    decisions = [d for _, ds in found for d in ds if d is not None]
    assert decisions and all(d == decisions[0] for d in decisions[: len(paces)])  # the same decision on every group
    last = found[-1][0]
    assert last[0].shares == last[1].shares and sum(last[0].shares) == 16 and last[0].shares[1] < last[0].shares[0] < 16
    assert last[0].shares[1] in (4, 5), last[0].shares  # a third of the speed: about a quarter of the samples
    assert paces[0].samples() + paces[1].samples() == 16
    # a try that did not commit teaches nothing; a new quorum starts even
    step.n += 1
    seats, _ = step(paces, [0.001, 0.003], commit=False)
    assert paces[0].heard is None and paces[0].mine is None
    step.n -= 1
    seats, _ = step(paces, [0.001, 0.003], quorum=1)
    assert [s.shares for s in seats] == [None, None] and paces[1].samples() == 8


def test_equal_groups_keep_even_shares_and_a_spare_takes_none():
    step.n = 0
    paces = groups(3, training_replicas=2)
    found = run(paces, [0.002, 0.002, 0.0001], 8)  # the spare, fastest, is not a training group
    assert all(seat.shares is None for seats, _ in found for seat in seats)
    assert [pace.samples() for pace in paces] == [8, 8, 0]


def test_a_group_rebalancing_cannot_keep_up_with_is_named_on_every_group():
    step.n = 0
    paces = groups(2, straggler_leave_factor=3.0)
    found = run(paces, [0.001, 0.02], 8)  # 20x slower a sample
    behind = [d.behind for _, ds in found for d in ds if d is not None and d.behind]
    assert behind and all(list(b) == [1] for b in behind), behind


def test_reports_sum_into_each_groups_slot():
    paces = groups(2)
    step.n = 0
    step(paces, [0.001, 0.002])
    sent = [pace.report(2) for pace in paces]
    assert sent[0][2:].abs().sum() == 0 and sent[1][:2].abs().sum() == 0  # each in its own slot, zeros elsewhere
    assert torch.equal((sent[0] + sent[1]).reshape(-1, 2)[:, 1], torch.tensor([8.0, 8.0], dtype=torch.float64))
