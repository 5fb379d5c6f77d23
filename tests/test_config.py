"""Configuration: YAML + flags into typed dataclasses; bad input is one clear line and nothing on disk."""

from __future__ import annotations

import dataclasses

import pytest

from infra.arguments import TrainingArguments
from infra.config import ConfigError, _parse, flatten, resolved
from tests import recipe_forks
from tests.conftest import REPO


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_sets_fields_and_flags_override_it(tmp_path):
    cfg = write(tmp_path, "learning_rate: 1e-3\nmax_steps: 7\nsave_total_limit: null\nrun_name: a\n")
    (args,) = _parse((TrainingArguments,), ["--config", cfg, "--max_steps", "9"])
    assert args.learning_rate == 1e-3  # PyYAML reads 1e-3 as a string; it is converted like a flag
    assert args.max_steps == 9  # the flag wins over the YAML
    assert args.save_total_limit is None
    assert args.run_name == "a"
    assert args.seed == TrainingArguments.seed


@pytest.mark.parametrize(
    ("yaml_text", "argv", "expected"),
    [
        ("learning_rat: 0.1\n", [], "unknown key 'learning_rat' (did you mean 'learning_rate'?)"),
        ("max_steps: many\n", [], "max_steps='many' is not valid: expected an integer"),
        ("", ["--learning_rate", "fast"], "learning_rate='fast' is not valid: expected a number"),
        ("max_steps: 0\n", [], "max_steps=0 is not valid: expected an integer >= 1"),
        ("", ["--report_to", "wandb"], "invalid choice: 'wandb'"),
        ("", ["--max_step", "1"], "unknown argument '--max_step 1' (did you mean '--max_steps'?)"),
        ("- a\n- b\n", [], "expected a mapping of field: value"),
        ("", ["--output_dir", "s3://b/run"], "output_dir='s3://b/run' is not valid: expected a local or shared folder"),
        ("", ["--checkpoint_upload_dir", "/tmp/x"], "checkpoint_upload_dir='/tmp/x' is not valid: expected an fsspec URL"),
        ("", ["--fault_tolerance", "replica"], "fault_tolerance='replica' is not valid: expected none or replicas"),
        (
            "",
            ["--fault_tolerance", "replicas", "--lighthouse", "http://h:29510"],
            "replica_group_id='' is not valid: expected letters, digits, '_', '-' or '.', ending in a digit",
        ),
        (
            "",
            ["--fault_tolerance", "replicas", "--replica_group_id", "a1", "--lighthouse", "h:29510"],
            "lighthouse='h:29510' is not valid: expected http://HOST:PORT",
        ),
    ],
)
def test_bad_values_name_the_field_and_what_is_accepted(tmp_path, yaml_text, argv, expected):
    with pytest.raises(ConfigError) as err:
        _parse((TrainingArguments,), ["--config", write(tmp_path, yaml_text), *argv])
    assert expected in str(err.value)


def test_resolved_config_flattens_to_dotted_params():
    flat = flatten(resolved(TrainingArguments(max_steps=3)))
    assert flat["TrainingArguments.max_steps"] == 3
    assert all("." in key for key in flat)


@pytest.mark.parametrize(
    ("yaml_text", "extra", "expected"),
    [
        ("hidden_sise: 64\n", [], "unknown key 'hidden_sise' (did you mean 'hidden_size'?)"),
        ("per_device_train_batch_size: 2.5\n", [], "per_device_train_batch_size='2.5' is not valid: expected an integer"),
        (None, [], "no such file"),
        (
            "keep_best: 2\n",
            ["--metric_for_best_model", "eval/loss"],
            "eval_samples=0 is not valid: expected > 0 to rank checkpoints by eval/loss",
        ),
        ("data_mixture:\n  - {name: a, data_dir: x, weight: -1}\n", [], "data_mixture weight='-1' of 'a' is not valid: expected a number"),
        ("", ["--data_mixture", "name=a,data_dir=x"], "data_mixture item 'name=a,data_dir=x' is not valid: expected name=..., data_dir="),
        ("", ["--attn_implementation", "flash"], "attn_implementation='flash' is not valid: expected one of sdpa, eager,"),
        (
            "",
            ["--fault_tolerance", "replicas", "--replica_group_id", "0", "--lighthouse", "http://h:29510"],
            "global_batch_size=0 is not valid: expected > 0 with fault_tolerance=replicas",
        ),
        (
            "data_mixture:\n  - {name: a, data_dir: x, weight: 1}\n",
            ["--fault_tolerance", "replicas", "--replica_group_id", "0", "--lighthouse", "http://h:29510", "--global_batch_size", "16"],
            "data_mixture=",
        ),
        ("", ["--attn_implementation", "flash_attention_2"], "expected an installed kernel: flash_attention_2 needs a CUDA GPU"),
        ("", ["--attn_implementation", "flex_attention"], "expected a kernel that trains here: flex_attention needs a CUDA GPU"),
        ("", ["--straggler_action", "rebalance", "--straggler_min_samples", "9"], "straggler_min_samples=9 is not valid: expected at most"),
        ("", ["--straggler_leave_factor", "1.2"], "straggler_leave_factor=1.2 is not valid: expected 0 or a number > straggler_factor"),
        (
            "",
            ["--straggler_replay", "runs/a", "--straggler_action", "rebalance"],
            "straggler_replay='runs/a' is not valid: expected a run's checkpoint or output_dir, with straggler_action warn or",
        ),
        (
            "",
            [
                "--straggler_action",
                "rebalance",
                "--fault_tolerance",
                "replicas",
                "--global_batch_size",
                "16",
                "--replica_group_id",
                "g0",
                "--lighthouse",
                "http://127.0.0.1:1",
                "--straggler_min_samples",
                "99",
            ],
            "straggler_min_samples=99 is not valid: expected at most the even share of a micro-step",
        ),
        ("", ["--sdc_check_steps", "0"], "sdc_check_steps=0 is not valid: expected an integer >= 1 (sdc_action=off: no check)"),
        ("", ["--sdc_spike_factor", "1"], "sdc_spike_factor=1.0 is not valid: expected 0 (no spike check) or a number > 1"),
    ],
)
def test_recipe_refuses_bad_config_in_one_line_and_creates_nothing(tmp_path, yaml_text, extra, expected):
    cfg = write(tmp_path, yaml_text) if yaml_text is not None else str(tmp_path / "missing.yaml")
    out = tmp_path / "out"
    env_store = tmp_path / "mlflow.db"
    proc = recipe_forks.run(
        REPO / "recipes" / "pretrain_clm.py",
        ["--config", cfg, "--output_dir", str(out), *extra],
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": f"sqlite:///{env_store}", "PATH": ""},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("config error: ") and expected in lines[0]
    assert not out.exists() and not env_store.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["run.yaml"] if yaml_text is not None else [])


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "accelerate_configs").glob("*.yaml")))
def test_every_launcher_config_loads_with_accelerates_own_loader(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(REPO / "accelerate_configs" / name))
    assert config.mixed_precision is None  # precision is the recipe's mixed_precision: one place


# The command line and YAML keys users' scripts and configs rely on, with their defaults. A change here breaks them:
# deliberate changes update this list in the same commit, and say so in its message.
FROZEN_SURFACE = {
    "TrainingArguments": {
        "output_dir": "runs/default",
        "seed": 42,
        "full_determinism": False,
        "max_steps": 200,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "global_batch_size": 0,
        "log_level": "info",
        "fault_tolerance": "none",
        "replica_group_id": "",
        "lighthouse": "",
        "min_replicas": 1,
        "training_replicas": 0,
        "replica_timeout_seconds": 30.0,
        "quorum_timeout_seconds": 120.0,
        "logging_steps": 10,
        "eval_steps": 0,
        "per_device_eval_batch_size": 8,
        "gradient_checkpointing": False,
        "torch_compile": False,
        "torch_compile_mode": "default",
        "torch_compile_backend": "inductor",
        "gradient_sum": "rank_ordered",
        "learning_rate": 0.001,
        "warmup_steps": 20,
        "min_lr_ratio": 0.1,
        "weight_decay": 0.1,
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "max_grad_norm": 1.0,
        "lr_scheduler_type": "cosine",
        "decay_ratio": 0.1,
        "mixed_precision": "auto",
        "save_steps": 100,
        "save_every_minutes": "30",
        "mtbf_hours": 24.0,
        "save_total_limit": 2,
        "keep_best": 0,
        "metric_for_best_model": "train/loss",
        "greater_is_better": False,
        "save_milestone_steps": 0,
        "async_save": False,
        "verify_checksums": True,
        "resume_from_checkpoint": "auto",
        "checkpoint_upload_dir": None,
        "preemption_grace_seconds": 120.0,
        "max_bad_steps": 3,
        "on_bad_steps": "rollback",
        "max_rollbacks": 3,
        "ddp_timeout": 1800,
        "ddp_step_timeout": 0,
        "straggler_window_steps": 50,
        "straggler_factor": 1.5,
        "straggler_patience": 3,
        "straggler_action": "warn",
        "straggler_min_samples": 1,
        "straggler_read_ahead": True,
        "straggler_leave_factor": 4.0,
        "straggler_replay": "",
        "sdc_check_steps": 50,
        "sdc_action": "auto",
        "sdc_replay": "auto",
        "sdc_spike_factor": 10.0,
        "preflight": True,
        "preflight_only": False,
        "time_budget_hours": 0.0,
        "run_name": None,
        "experiment_name": None,
        "report_to": "mlflow",
        "log_model": False,
        "register_model": None,
    },
    "DataArguments": {
        "data_dir": "data/stdlib",
        "eval_samples": 0,
        "num_workers": 0,
        "shuffle_window": 262144,
        "verify_data_checksums": False,
        "trace_samples": False,
        "data_mixture": None,
        "new_mixture_segment": False,
    },
}


def test_the_command_line_surface_is_frozen():
    from infra.data import DataArguments

    for section in (TrainingArguments, DataArguments):
        surface = {f.name: f.default for f in dataclasses.fields(section)}
        assert surface == FROZEN_SURFACE[section.__name__], f"{section.__name__}: flags or defaults changed"
        (parsed,) = _parse((section,), [])  # every flag parses from nothing to its default
        assert dataclasses.asdict(parsed) == FROZEN_SURFACE[section.__name__]
    assert {f.name for f in dataclasses.fields(TrainingArguments)} == set(resolved(TrainingArguments())["TrainingArguments"])


def test_global_batch_size_decides_the_accumulation_for_the_processes_launched():
    from infra.accelerator import accumulate_for_global_batch

    args = TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=3, global_batch_size=16)
    for processes, steps in ((2, 2), (1, 4), (4, 1)):
        accumulate_for_global_batch(args, processes)
        assert args.gradient_accumulation_steps == steps
    with pytest.raises(ConfigError) as err:
        accumulate_for_global_batch(args, 3)
    assert str(err.value) == ("global_batch_size=16 is not valid: expected a multiple of per_device_train_batch_size x processes = 4 x 3")
    unset = TrainingArguments(per_device_train_batch_size=4, gradient_accumulation_steps=3)
    accumulate_for_global_batch(unset, 2)
    assert unset.gradient_accumulation_steps == 3


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--num_machines", "2", "--max_restarts", "3"], None),
        (["--num_machines", "2", "--min_machines", "1", "--max_restarts", "3"], None),
        (["--num_machines", "2", "--min_machines=2"], None),  # not elastic: no restart needed
        (["--num_machines", "2", "--min_machines", "3"], "min_machines=3 is not valid: expected an integer from 1 to num_machines=2"),
        (["--num_machines", "2", "--min_machines", "x"], "min_machines=x is not valid: expected an integer from 1 to num_machines=2"),
        (
            ["--num_machines", "2", "--min_machines", "1"],
            "min_machines=1 needs --max_restarts >= 1: the job shrinks and grows again by restarting its group",
        ),
        (
            ["--num_machines", "2", "--min_machines", "1", "--max_restarts", "1", "--rdzv_backend", "static"],
            "min_machines=1 needs the c10d rendezvous, not --rdzv_backend static",
        ),
    ],
)
def test_min_machines_is_checked_before_the_launch(argv, expected):
    from infra.rendezvous import elastic_problem, without

    assert elastic_problem(argv) == expected
    assert without(["--min_machines", "1", "--a", "b", "--min_machines=1", "c"], "--min_machines") == ["--a", "b", "c"]


@pytest.mark.parametrize("value", ["-1e-3", "-2.5E+2", "-.5", "-3"])
def test_a_negative_number_is_a_value_in_any_notation(value):
    """argparse's own pattern of negative numbers has no exponent: `--learning_rate -1e-3` said "expected one argument"."""
    with pytest.raises(ConfigError, match=f"^learning_rate={float(value)!r} is not valid: expected a number > 0$"):
        _parse((TrainingArguments,), ["--learning_rate", value])
