"""Tracking: what reaches MLflow (no secrets, within limits), how runs end, and `make compare`."""

from __future__ import annotations

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from infra.compare import main as compare
from infra.tracking import MAX_PARAM_LENGTH, REDACTED, TRUNCATED, end_run, run_status, safe_params


def test_secrets_never_become_params_and_long_values_are_cut(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "my-private-hub-credential")
    config = {
        "ModelArguments": {"model_name_or_path": "org/model", "hub_token": "abc", "tokenizer": "gpt2"},
        "DataArguments": {"source": "s3://bucket/data?sig=my-private-hub-credential", "note": "key hf_" + "a" * 30},
        "TrainingArguments": {"learning_rate": 0.001, "api_key": None, "run_name": "x" * 7000, "max_tokens": 5},
    }
    params = safe_params(config)
    assert params["ModelArguments.hub_token"] == REDACTED  # by its name
    assert params["DataArguments.source"] == REDACTED  # holds the value of a known secret variable
    assert params["DataArguments.note"] == REDACTED  # shaped like a hub token
    assert params["ModelArguments.tokenizer"] == "gpt2" and params["TrainingArguments.max_tokens"] == "5"
    assert params["TrainingArguments.api_key"] == "None"  # nothing to hide
    assert params["ModelArguments.model_name_or_path"] == "org/model" and params["TrainingArguments.learning_rate"] == "0.001"
    long = params["TrainingArguments.run_name"]
    assert len(long) == MAX_PARAM_LENGTH and long.endswith(TRUNCATED)


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


@pytest.mark.parametrize(
    ("error", "status"), [(RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED"), (SystemExit("config error"), "FAILED")]
)
def test_a_crash_ends_the_run_failed_and_an_interrupt_killed(store, error, status):
    run = mlflow.start_run()
    with pytest.raises(type(error)), run_status():
        raise error
    assert mlflow.active_run() is None
    assert mlflow.MlflowClient(store).get_run(run.info.run_id).info.status == status


def test_a_normal_exit_leaves_the_run_to_finish(store):
    run = mlflow.start_run()
    with pytest.raises(SystemExit), run_status():
        raise SystemExit(0)
    assert mlflow.active_run().info.run_id == run.info.run_id
    end_run("FINISHED")
    assert mlflow.MlflowClient(store).get_run(run.info.run_id).info.status == "FINISHED"


def test_compare_prints_a_table_and_plots_the_curves(store, tmp_path, capsys):
    client = mlflow.MlflowClient(store)
    experiment = client.create_experiment("pretrain_clm")
    long = "lr0.001-a-run-name-longer-than-any-column-width"
    for name, lr, losses in (("lr0.01", "0.01", [5.0, 4.0, 3.5]), (long, "0.001", [5.0, 4.8, 4.6])):
        run = client.create_run(experiment, run_name=name)
        client.log_param(run.info.run_id, "TrainingArguments.learning_rate", lr)
        client.log_param(run.info.run_id, "TrainingArguments.max_steps", "30")
        client.log_param(run.info.run_id, "TrainingArguments.per_device_train_batch_size", "8")
        client.log_param(run.info.run_id, "TrainingArguments.gradient_accumulation_steps", "2")
        client.log_param(run.info.run_id, "TrainingArguments.global_batch_size", "0" if lr == "0.01" else "48")
        client.set_tag(run.info.run_id, "world_size", "4")
        for step, loss in enumerate(losses, 1):
            client.log_metric(run.info.run_id, "train/loss", loss, step=step * 10)
        client.log_metric(run.info.run_id, "perf/tokens_per_second", 12345.0, step=30)
        client.log_metric(run.info.run_id, "goodput/ettr", 0.913, step=30)
        client.set_terminated(run.info.run_id, "FINISHED")
    png = tmp_path / "compare.png"
    compare(["--experiment", "pretrain_clm", "--output", str(png)])
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("lr0.")}
    assert lines["lr0.01"][1:4] == ["FINISHED", "0.01", "64"] and "3.5000" in lines["lr0.01"]  # 8 x 2 x 4 processes
    assert lines[long][3] == "48"  # a global_batch_size set: the step's samples whatever the processes
    assert "12,345 tokens/s 0.91" in " ".join(lines["lr0.01"])  # the throughput whole (it was cut), goodput's ETTR
    assert lines[long][2] == "0.001" and "4.6000" in lines[long]  # a long name whole, its row still in columns
    header = next(line for line in out.splitlines() if line.startswith("run "))
    assert [row.index(lines[name][-1]) for name in ("lr0.01", long) for row in out.splitlines() if row.startswith(name + " ")] == [
        header.index("run id")
    ] * 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as exit_:
        compare(["--experiment", "nope", "--output", str(png)])
    assert exit_.value.code == 2 and "experiment='nope' is not in" in capsys.readouterr().err


@pytest.mark.slow  # minutes: out of the quick suite; CI runs it after the matrix (make test-ci-slow)
@pytest.mark.ci
@pytest.mark.multiprocess
def test_a_tracking_server_outage_delays_metrics_but_loses_none(small_data, tmp_path):
    """A real `mlflow server`, killed while the recipe runs and started again: one run, every point, one warning.
    Then a second run with another learning rate: both are in the server, ready to compare."""
    import os
    import signal
    import subprocess
    import time
    import urllib.request

    from tests.conftest import BIN, REPO, free_port, launch_command
    from tests.test_pretrain import recipe_args

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server_cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}"]
    server_cmd += ["--default-artifact-root", str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]

    def serve() -> subprocess.Popen:
        server = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    return server
            except OSError:
                time.sleep(0.3)
        raise AssertionError("mlflow server did not come up")

    server = serve()
    steps = 200
    cmd, env = launch_command("cpu.yaml", recipe_args(small_data, tmp_path / "out", steps, "--save_steps", "100"), tmp_path)
    log = tmp_path / "launch.log"
    with open(log, "w") as f:
        run = subprocess.Popen(cmd, cwd=REPO, env={**env, "MLFLOW_TRACKING_URI": uri}, stdout=f, stderr=subprocess.STDOUT)
    try:
        client = mlflow.MlflowClient(uri)
        deadline = time.monotonic() + 300
        while True:  # until the run has logged a few points
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            experiment = client.get_experiment_by_name("pretrain_clm")
            found = client.search_runs([experiment.experiment_id]) if experiment else []
            if found and len(client.get_metric_history(found[0].info.run_id, "train/loss")) >= 2:
                break
            time.sleep(0.2)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        assert run.poll() is None  # the recipe keeps logging into the outage
        time.sleep(3)
        server = serve()
        assert run.wait(timeout=300) == 0, log.read_text()[-3000:]
        output = log.read_text()
        (found,) = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
        assert found.info.status == "FINISHED"
        history = client.get_metric_history(found.info.run_id, "train/loss")
        assert sorted(m.step for m in history) == list(range(2, steps + 1, 2))  # none lost, none twice
        assert output.count("warning: tracking store unreachable") == 1  # one line for the outage, not one per step
        assert "tracking store reachable again" in output
        assert not (tmp_path / "out" / "unsent_metrics.jsonl").exists()

        # a second run with another learning rate: both are there to compare, with params, tags and curves
        # with a held-out eval and the final model registered
        other = recipe_args(small_data, tmp_path / "other", 20, "--learning_rate", "3e-3", "--eval_samples", "40", "--eval_steps", "10")
        other += ["--register_model", "tiny-clm"]
        cmd, env = launch_command("cpu.yaml", other, tmp_path)
        assert subprocess.run(cmd, cwd=REPO, env={**env, "MLFLOW_TRACKING_URI": uri}, capture_output=True, timeout=300).returncode == 0
        runs = client.search_runs([client.get_experiment_by_name("pretrain_clm").experiment_id])
        assert sorted(r.data.params["TrainingArguments.learning_rate"] for r in runs) == ["0.003", "0.01"]
        for r in runs:
            assert r.info.status == "FINISHED" and r.data.tags["world_size"] == "2" and r.data.tags["recipe"] == "pretrain_clm"
            assert len(client.get_metric_history(r.info.run_id, "train/loss")) >= 10
        second = next(r for r in runs if r.data.params["TrainingArguments.learning_rate"] == "0.003")
        evals = client.get_metric_history(second.info.run_id, "eval/loss")
        assert [m.step for m in evals] == [10, 20] and evals[1].value < evals[0].value
        (version,) = client.search_model_versions("name='tiny-clm'")
        assert version.run_id == second.info.run_id
        mlflow.set_tracking_uri(uri)
        pipeline = mlflow.transformers.load_model(f"models:/tiny-clm/{version.version}")  # the exported weights, as MLflow serves them
        exported = load_file(tmp_path / "other" / "final" / "model.safetensors")
        served = pipeline.model.state_dict()
        assert all(torch.equal(served[name], tensor) for name, tensor in exported.items())
    finally:
        mlflow.set_tracking_uri(None)
        os.killpg(server.pid, signal.SIGKILL)
        run.kill()


def test_mfu_needs_a_known_peak():
    from infra.metrics import flops_per_token, peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12  # the specific name wins over the family
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("Some Future GPU") is None and peak_bf16_flops(None) is None  # no number rather than a wrong one
    assert flops_per_token(1_000_000, 2, 128, 256) == 6e6 + 12 * 2 * 128 * 256


def test_train_metrics_average_the_finite_steps_of_each_window():
    import math

    import torch
    from accelerate import Accelerator

    from infra.metrics import TrainMetrics

    metrics = TrainMetrics(Accelerator(cpu=True), "tokens", flops_per_unit=None)
    metrics.add_loss(torch.tensor(6.0), items=2)  # a step of 2 items whose losses sum to 6
    metrics.add_loss(torch.tensor(2.0), items=2)
    metrics.count_step(512)
    logged, mean = metrics.collect(learning_rate=1e-3, units_seen=512, epoch=0, grad_norm=torch.tensor(0.5))
    assert mean == logged["train/loss"] == 2.0  # (6 + 2) / 4 items
    assert logged["train/learning_rate"] == 1e-3 and logged["train/tokens_seen"] == 512 and logged["train/grad_norm"] == 0.5
    assert logged["perf/tokens_per_second"] > 0 and "perf/mfu" not in logged  # no peak known on a CPU: no MFU
    logged, mean = metrics.collect(learning_rate=1e-3, units_seen=512, epoch=0, grad_norm=None)
    assert math.isnan(mean) and "train/loss" not in logged and "train/grad_norm" not in logged  # every step skipped


def test_a_recipe_s_metrics_are_their_mean_per_sample_over_the_steps_taken():
    """LossOutput.metrics: sums over each micro-batch's samples, logged as their mean per sample over the window; a
    skipped step's are dropped, and the next window starts empty."""
    import torch
    from accelerate import Accelerator

    from infra.metrics import TrainMetrics

    metrics = TrainMetrics(Accelerator(cpu=True), "tokens", flops_per_unit=None)
    metrics.add_recipe_metrics({"rewards/margins": torch.tensor(3.0), "rewards/accuracies": torch.tensor(2.0)}, samples=4)
    metrics.add_recipe_metrics({"rewards/margins": torch.tensor(1.0), "rewards/accuracies": torch.tensor(0.0)}, samples=4)
    metrics.end_step(keep=True)  # a step of two micro-batches: 8 pairs
    metrics.add_recipe_metrics({"rewards/margins": torch.tensor(100.0), "rewards/accuracies": torch.tensor(4.0)}, samples=4)
    metrics.end_step(keep=False)  # skipped: not counted
    metrics.add_recipe_metrics({"rewards/margins": torch.tensor(-2.0), "rewards/accuracies": torch.tensor(1.0)}, samples=2)
    metrics.end_step(keep=True)
    logged, _ = metrics.collect(learning_rate=0.0, units_seen=0, epoch=0, grad_norm=None)
    assert logged["train/rewards/margins"] == 2.0 / 10 and logged["train/rewards/accuracies"] == 3.0 / 10
    logged, _ = metrics.collect(learning_rate=0.0, units_seen=0, epoch=0, grad_norm=None)
    assert "train/rewards/margins" not in logged


def test_points_a_dead_store_never_took_end_in_the_fallback_file(tmp_path, monkeypatch, capsys):
    import json

    from infra.tracking import MetricLogger
    from tests.conftest import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    logger = MetricLogger("0123456789abcdef", tmp_path / "unsent.jsonl", retry_seconds=0.1)
    for step in (1, 2, 3):
        logger.log({"train/loss": 1.0 / step}, step=step)
    logger.close(timeout=1.0)
    lines = [json.loads(line) for line in (tmp_path / "unsent.jsonl").read_text().splitlines()]
    assert [(p["key"], p["step"], p["value"]) for p in lines] == [("train/loss", s, 1.0 / s) for s in (1, 2, 3)]
    out = capsys.readouterr().out
    assert out.count("tracking store unreachable") == 1 and "3 metric points could not reach the tracking store" in out


def test_a_server_down_at_start_sends_the_run_to_the_local_store(tmp_path, monkeypatch, capsys):
    """Training must not wait for the tracking server: the run starts in the local store, with one warning."""
    from accelerate import Accelerator

    from infra import tracking
    from tests.conftest import free_port

    local = f"sqlite:///{tmp_path / 'local.db'}"
    monkeypatch.setattr(tracking, "DEFAULT_URI", local)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    config = {"TrainingArguments": {"learning_rate": 0.01, "hf_token": "hf_abcdefghijklmnopqrstuvwxyz0123"}}
    try:
        run_id = tracking.start_run(Accelerator(log_with="mlflow"), "exp", "lr0.01", config, tmp_path / "out", tags={"recipe": "x"})
        mlflow.log_metric("train/loss", 1.5, step=1)
        end_run("FINISHED")
    finally:
        mlflow.set_tracking_uri(None)
    assert capsys.readouterr().out.count("unreachable") == 1
    run = mlflow.MlflowClient(local).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["recipe"] == "x" and run.data.metrics["train/loss"] == 1.5
    assert run.data.params == {"TrainingArguments.learning_rate": "0.01", "TrainingArguments.hf_token": REDACTED}
    assert (tmp_path / "out" / "mlflow_run_id").read_text() == run_id


def test_jobs_that_start_together_on_a_new_store_log_to_it(store, tmp_path, monkeypatch, capsys):
    """Replica groups (or jobs) starting at once on a new store each look the experiment up, find none and create it: one
    wins and the others' creates fail (measured: 2 of 30 tries of three processes). Here another job creates it between
    this one's look-up and its create; the run must still land in the store's one experiment, not in the fallback."""
    from accelerate import Accelerator

    from infra import tracking

    local = f"sqlite:///{tmp_path / 'local.db'}"
    monkeypatch.setattr(tracking, "DEFAULT_URI", local)
    create = mlflow.MlflowClient.create_experiment

    def another_job_first(self, name, *args, **kwargs):  # the race, lost every time
        monkeypatch.setattr(mlflow.MlflowClient, "create_experiment", create)
        create(mlflow.MlflowClient(store), name)
        return create(self, name, *args, **kwargs)

    monkeypatch.setattr(mlflow.MlflowClient, "create_experiment", another_job_first)
    try:
        run_id = tracking.start_run(Accelerator(log_with="mlflow"), "exp", "lr0.01", {"T": {"lr": 0.01}}, tmp_path / "out")
        end_run("FINISHED")
    finally:
        mlflow.set_tracking_uri(None)
    assert "unreachable" not in capsys.readouterr().out
    client = mlflow.MlflowClient(store)
    assert [run.info.run_id for run in client.search_runs([client.get_experiment_by_name("exp").experiment_id])] == [run_id]


def test_a_generated_run_name_tells_runs_of_other_folders_apart_and_counts_every_process_s_samples():
    from types import SimpleNamespace

    from infra.tracking import run_name_for

    def config(output_dir: str) -> dict:
        return {"TrainingArguments": {"output_dir": output_dir, "learning_rate": 2e-3, "seed": 42}}

    args = SimpleNamespace(run_name=None)
    assert run_name_for(config("runs/a"), args, 64) == "a-lr0.002-b64-s42"
    assert run_name_for(config("runs/b/"), args, 64) == "b-lr0.002-b64-s42"
    assert run_name_for(config("runs/a"), SimpleNamespace(run_name="mine"), 64) == "mine"
