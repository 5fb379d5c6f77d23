"""The optimizer's groups, and the learning-rate schedules: their shapes, and a resumed schedule that gives the straight
run's rates."""

from __future__ import annotations

import pytest
import torch

from infra.optim import OptimizerConfig, build_optimizer, build_scheduler

STEPS = 20


def fresh(config: OptimizerConfig):
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=config.learning_rate)
    return optimizer, build_scheduler(optimizer, config, STEPS)


def rates(optimizer, scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant_with_warmup", "warmup_stable_decay"])
def test_a_resumed_schedule_gives_the_straight_runs_learning_rates(kind):
    config = OptimizerConfig(learning_rate=1.0, warmup_steps=4, min_lr_ratio=0.1, lr_scheduler_type=kind, decay_ratio=0.25)
    straight = rates(*fresh(config), STEPS)
    optimizer, scheduler = fresh(config)
    first = rates(optimizer, scheduler, 7)
    saved = optimizer.state_dict(), scheduler.state_dict()  # what save_state keeps of them
    optimizer, scheduler = fresh(config)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert first + rates(optimizer, scheduler, STEPS - 7) == straight
    start = 0.1 if kind == "warmup_stable_decay" else 0.0  # transformers' WSD warms up from min_lr_ratio
    assert straight[:5] == pytest.approx([start + (1 - start) * i / 4 for i in range(5)])  # linear warmup to the peak
    after = straight[4:]
    if kind == "constant_with_warmup":
        assert after == [1.0] * len(after)
    elif kind == "warmup_stable_decay":  # stable to step 15, then 5 steps (a quarter of 20) down to the floor
        assert after[:11] == [1.0] * 11 and all(a > b for a, b in zip(after[11:], after[12:], strict=False))
        assert after[-1] == pytest.approx(0.1 + 0.9 / 5)
    else:  # decaying from the peak towards min_lr_ratio (cosine) or 0 (linear) at max_steps
        assert all(a > b for a, b in zip(after, after[1:], strict=False)) and after[-1] > (0.1 if kind == "cosine" else 0.0)


def test_warmup_must_end_before_the_decay_of_warmup_stable_decay():
    from infra.arguments import TrainingArguments
    from infra.config import ConfigError

    with pytest.raises(ConfigError, match="warmup_steps=18 is not valid: expected at most max_steps - decay steps = 15"):
        TrainingArguments(max_steps=20, warmup_steps=18, lr_scheduler_type="warmup_stable_decay", decay_ratio=0.25)


def test_weight_matrices_are_decayed_by_their_shape_even_as_zero3_partitions():
    """ZeRO-3's zero.Init leaves each parameter an empty 1-d partition with its shape in `ds_shape`: a matrix still
    decays, a norm does not; and the fused AdamW where torch has one (CPU)."""
    model = torch.nn.Module()
    model.matrix, model.norm, model.partitioned = (torch.nn.Parameter(torch.ones(s)) for s in ((2, 3), (3,), (0,)))
    model.partitioned.ds_shape = torch.Size((4, 4))
    optimizer = build_optimizer(model, OptimizerConfig(learning_rate=1e-3, weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert [p.shape for p in decay["params"]] == [(2, 3), (0,)] and decay["weight_decay"] == 0.1
    assert [p.shape for p in no_decay["params"]] == [(3,)] and no_decay["weight_decay"] == 0.0
    assert optimizer.defaults["fused"]
