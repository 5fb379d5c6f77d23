"""Goodput's ledger over launches, on a clock the test moves: what is kept, what a crash loses, what a restart costs."""

from __future__ import annotations

import pytest

from infra.goodput import Goodput, summary


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_crash_loses_what_was_trained_after_the_checkpoint_and_a_restart_is_counted_apart(tmp_path):
    clock = Clock()
    # launch 1: starts at 1000, trains from 1010; a checkpoint at 1060 (its save stalls 5 s); alive at 1105; dies at 1110
    first = Goodput(tmp_path, main=True, launch_start=1000.0, clock=clock)
    first.resume({})
    clock.now = 1010.0
    first.first_step()
    clock.now = 1060.0
    manifest = {"goodput": first.ledger()}
    with first.stall("checkpoint"):
        clock.now = 1065.0
    clock.now = 1105.0
    first.alive()
    ledger = {
        "first_launch": 1000.0,
        "idle": 0.0,
        "train": 50.0,
        "startup": 10.0,
        "checkpoint": 0.0,
        "eval": 0.0,
        "restart": 0.0,
        "repair": 0.0,
    }
    assert manifest["goodput"] == ledger
    assert first.metrics()["goodput/checkpoint_seconds"] == 5.0 and first.metrics()["goodput/ettr"] == pytest.approx(90 / 105)

    # launch 2: starts at 1140 from that checkpoint, first step at 1150, an eval of 10 s, at 1200 the numbers
    clock.now = 1140.0
    second = Goodput(tmp_path, main=True, launch_start=1140.0, clock=clock)
    second.resume(manifest)
    clock.now = 1150.0
    second.first_step()
    clock.now = 1180.0
    with second.stall("eval"):
        clock.now = 1190.0
    clock.now = 1200.0
    m = second.metrics()
    assert m["goodput/wall_seconds"] == 200.0
    assert m["goodput/train_seconds"] == 50.0 + 40.0  # launch 1's first 50 s, launch 2's loop less its eval
    assert m["goodput/startup_seconds"] == 20.0 and m["goodput/eval_seconds"] == 10.0
    assert m["goodput/restart_seconds"] == 35.0  # from launch 1's last sign of life to launch 2's start
    assert m["goodput/lost_seconds"] == 45.0  # launch 1 after its checkpoint: its save, and 40 s of steps done again
    assert m["goodput/ettr"] == pytest.approx(0.45)
    line = summary(m)
    parts = "train 45%, start-up 10%, checkpoints 0%, eval 5%, restarts 18%, repairs 0%, lost 22%"
    assert line == f"goodput: ETTR 0.45 of 200s since the first launch ({parts})"
    short = {**m, "goodput/startup_seconds": 101.0}  # a run whose start-up is most of it: said as what it is
    assert summary(short).endswith("lost 22%); mostly start-up, a fixed cost of each launch that a long run spreads thin")


def test_a_launch_that_never_reached_a_checkpoint_is_still_part_of_the_run(tmp_path):
    clock = Clock()
    first = Goodput(tmp_path, main=True, launch_start=1000.0, clock=clock)
    first.resume({})
    clock.now = 1030.0
    first.first_step()
    first.alive()
    clock.now = 1100.0
    second = Goodput(tmp_path, main=True, launch_start=1100.0, clock=clock)
    second.resume({})  # no checkpoint: the run began with the first launch all the same
    m = second.metrics()
    assert m["goodput/wall_seconds"] == 100.0 and m["goodput/restart_seconds"] == 70.0 and m["goodput/startup_seconds"] == 0.0
    assert m["goodput/lost_seconds"] == 30.0


def test_a_rollback_undoes_the_steps_since_its_checkpoint(tmp_path):
    clock = Clock()
    g = Goodput(tmp_path, main=False, launch_start=1000.0, clock=clock)
    g.resume({})
    clock.now = 1010.0
    g.first_step()
    clock.now = 1050.0
    manifest = {"goodput": g.ledger()}
    clock.now = 1090.0
    g.rolled_back(manifest)
    clock.now = 1100.0
    m = g.metrics()
    assert m["goodput/train_seconds"] == 40.0 + 10.0 and m["goodput/startup_seconds"] == 10.0 and m["goodput/lost_seconds"] == 40.0
    assert not (tmp_path / "goodput.json").exists()  # only rank 0 writes it
    # a repair of silent data corruption (infra.sdc) back to the same checkpoint: its 40 s of steps since (1090-1130)
    # undone and counted as the repair's, not lost
    clock.now = 1130.0
    g.rolled_back(manifest, repair=True)
    m = g.metrics()
    assert m["goodput/train_seconds"] == 40.0 and m["goodput/repair_seconds"] == 40.0 and m["goodput/lost_seconds"] == 40.0


def test_a_finished_run_continued_later_is_not_charged_for_the_wait(tmp_path):
    """`make train ARGS="--max_steps 400"` a day after the run finished: the day is neither a restart nor lost."""
    clock = Clock()
    first = Goodput(tmp_path, main=True, launch_start=1000.0, clock=clock)
    first.resume({})
    clock.now = 1010.0
    first.first_step()
    clock.now = 1100.0
    manifest = {"goodput": first.ledger()}
    first.alive(finished=True)
    clock.now = 90_000.0
    later = Goodput(tmp_path, main=True, launch_start=90_000.0, clock=clock)
    later.resume(manifest)
    clock.now = 90_010.0
    later.first_step()
    clock.now = 90_100.0
    m = later.metrics()
    assert m["goodput/wall_seconds"] == 200.0 and m["goodput/restart_seconds"] == 0.0 and m["goodput/lost_seconds"] == 0.0
    assert m["goodput/ettr"] == pytest.approx(180 / 200)
