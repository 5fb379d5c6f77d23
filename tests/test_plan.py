"""The capacity planner and the failure simulation: the seed's worked example, and agreement with Young/Daly."""

from __future__ import annotations

import pytest

from infra.plan import PlanArguments, best_simulated_interval, daly_interval, expected_wall_minutes, main, plan, simulate, young_interval


def test_the_worked_example(capsys):
    """64 GPUs x 32 per GPU at 1.2 s/step; 30-minute checkpoints costing 2 minutes."""
    args = ["--gpus", "64", "--per_gpu_batch", "32", "--step_seconds", "1.2", "--checkpoint_minutes", "2", "--interval_minutes", "30"]
    main(args)
    out = capsys.readouterr().out
    assert "1,707 samples/s: global batch 2,048 = 64 GPUs x 32" in out
    assert "at most 30 min of work lost" in out and "plus 5 min to restart and reload" in out
    p = plan(PlanArguments(gpus=64, per_gpu_batch=32, step_seconds=1.2, checkpoint_minutes=2, interval_minutes=30))
    assert p.global_batch == 2048 and round(p.samples_per_second) == 1707 and p.worst_lost_minutes == 30
    assert p.young_minutes == pytest.approx(young_interval(2, p.job_mtbf_minutes)) and p.young_goodput > p.goodput


def test_the_simulated_best_interval_agrees_with_young_daly():
    """A week of training, a failure every 3 hours: ~56 failures per simulated run, 200 runs per interval."""
    checkpoint, restart, mtbf, work = 2.0, 5.0, 180.0, 168 * 60.0
    best, grid, goodput = best_simulated_interval(work, checkpoint, restart, mtbf, trials=200, seed=1)
    assert best == pytest.approx(daly_interval(checkpoint, mtbf), rel=0.03)
    assert best == pytest.approx(young_interval(checkpoint, mtbf), rel=0.08)  # first-order: a little long
    for t, g in zip(grid, goodput, strict=True):  # the simulation follows the closed-form expectation
        assert g == pytest.approx(work / expected_wall_minutes(work, t, checkpoint, restart, mtbf), rel=0.01)


def test_policies_rank_as_they_should():
    checkpoint, restart, mtbf, work = 2.0, 5.0, 180.0, 168 * 60.0
    daly, _ = simulate(work, daly_interval(checkpoint, mtbf), checkpoint, restart, mtbf, 100, 0)
    fixed, _ = simulate(work, 30.0, checkpoint, restart, mtbf, 100, 0)
    rare, _ = simulate(work, 600.0, checkpoint, restart, mtbf, 100, 0)
    none, lost = simulate(work, None, checkpoint, restart, mtbf, 100, 0)
    assert daly > fixed > rare > none and none < 1e-6  # no checkpoints: a week never finishes between failures


def test_simulate_writes_a_plot_and_bad_input_is_one_line(tmp_path, capsys):
    main(
        [
            "--step_seconds",
            "1",
            "--checkpoint_minutes",
            "1",
            "--mtbf_hours_per_node",
            "20",
            "--simulate",
            "--trials",
            "20",
            "--output",
            str(tmp_path / "g.png"),
        ]
    )
    assert (tmp_path / "g.png").stat().st_size > 10_000 and "Young/Daly" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--gpus", "0", "--step_seconds", "1"])
    assert exit_.value.code == 2 and "gpus=0 is not valid" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="step_seconds=0.0 is not valid"):
        main([])


def test_measured_figures_come_from_a_finished_run(tmp_path, monkeypatch, capsys):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("e", artifact_location=str(tmp_path / "a"))).info.run_id
    client.log_param(run, "TrainingArguments.per_device_train_batch_size", "16")
    client.log_param(run, "TrainingArguments.gradient_accumulation_steps", "2")
    for step, seconds in [(10, 9.0), (20, 1.0), (30, 1.5)]:  # the first window holds warm-up and is left out
        client.log_metric(run, "perf/step_time", seconds, step=step)
    client.log_metric(run, "checkpoint/save_seconds", 90.0, step=30)
    main(["--run_id", run, "--gpus", "8"])
    assert "8 GPUs x 32, 1.25 s/step" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="run_id='nope' is not valid"):
        main(["--run_id", "nope"])
