"""`--help` of every entry point a user types: each recipe and each `python -m infra...` tool prints its usage and exits 0
(a `%` in a help text once made every recipe's `--help` a traceback: argparse reads it as a format code)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.conftest import BIN, REPO, free_port

RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.py"))
TOOLS = [
    "infra.compare",
    "infra.export",
    "infra.launch",
    "infra.plan",
    "infra.data.prepare",
    "infra.data.tasks",
    "infra.replicas",
    "infra.stopped",
]


def help_of(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "1000"}  # a help text on one line
    return subprocess.run([str(BIN / "python"), *argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("entry", [f"recipes/{r}" for r in RECIPES] + [f"-m {t}" for t in TOOLS])
def test_every_entry_point_prints_its_help(entry):
    proc = help_of(*entry.split())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage:") and "Traceback" not in proc.stderr, proc.stdout[:500] + proc.stderr[-2000:]
    if entry.startswith("recipes/"):
        assert "--config" in proc.stdout and "--output_dir" in proc.stdout and "5% of" in proc.stdout


def test_a_recipes_help_lists_its_flags_by_section_with_the_values_of_a_config_beside_the_defaults():
    """`--config` first, then each section under its heading (the recipe's model and data, then the loop and each part's);
    with `--config FILE` a flag FILE sets to other than the default shows both values, one FILE leaves alone neither."""
    config = "recipes/configs/pretrain_clm.yaml"
    text = help_of("recipes/pretrain_clm.py", "--config", config).stdout
    assert text.startswith("usage: pretrain_clm.py [--config FILE.yaml] [--FIELD VALUE ...]\n"), text[:300]
    headings = [line[:-1] for line in text.splitlines() if re.fullmatch(r"[a-z][^ ].*:", line)]
    assert headings[:5] == ["options", "attention", "model", "data", "training loop, logging and eval"], headings
    assert {"optimizer and schedule", "checkpoints: when to save", "hangs and stragglers", "replica groups"} <= set(headings)
    assert text.index("--config FILE.yaml") < text.index("--hidden_size VALUE") < text.index("--learning_rate VALUE")
    flags = {m[1]: m[2] for m in re.finditer(r"^  (--\w+) [^ ]+ +(.*)$", text, re.M)}
    assert flags["--learning_rate"].endswith(f"[{config}: 0.002] (default: 0.001)"), flags["--learning_rate"]
    assert flags["--seed"].endswith("(default: 42)") and config not in flags["--seed"], flags["--seed"]
    assert "--learning-rate" not in text  # the dashed alias works, but is not listed twice
    assert config not in help_of("recipes/pretrain_clm.py").stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("mistake", "line"),
    [
        (["--learning_rat", "1e-3"], "config error: unknown argument '--learning_rat 1e-3' (did you mean '--learning_rate'?)"),
        (["--learning_rate", "-1e-3"], "config error: learning_rate=-0.001 is not valid: expected a number > 0"),
    ],
)
def test_a_mistake_launched_on_two_processes_is_one_line_and_exit_code_2(mistake, line, tmp_path):
    """What `make train ARGS=...` runs: the project's launcher, two processes, each finding the mistake; one says it,
    the launcher adds nothing (no traceback, no line of torch elastic's), and the exit code is the usage error's."""
    cmd = [str(BIN / "python"), "-m", "infra.launch", "--config_file", "accelerate_configs/cpu.yaml", "--num_processes", "2"]
    cmd += ["--main_process_port", str(free_port()), "recipes/pretrain_clm.py", "--config", "recipes/configs/pretrain_clm.yaml"]
    cmd += ["--output_dir", str(tmp_path / "out"), *mistake]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize(
    ("entry", "line"),
    [
        ("recipes/sft_clm.py --learning_rat 1", "config error: unknown argument '--learning_rat 1' (did you mean '--learning_rate'?)"),
        ("-m infra.data.prepare --sourc x", "config error: unknown argument '--sourc x' (did you mean '--source'?)"),
        ("-m infra.data.tasks --tsk sft", "config error: unknown argument '--tsk sft' (did you mean '--task'?)"),
        ("-m infra.plan --gpu 8", "config error: unknown argument '--gpu 8' (did you mean '--gpus'?)"),
        (
            "-m infra.compare --experimnt x",
            "python -m infra.compare: unrecognized arguments: --experimnt x (did you mean '--experiment'?); --help lists the arguments",
        ),
        (
            "-m infra.export --checkpoin x --output y",  # not taken for --checkpoint (no abbreviations)
            "python -m infra.export: the following arguments are required: --checkpoint; --help lists the arguments",
        ),
        (
            "-m infra.replicas local --grups 3",
            "python -m infra.replicas: unrecognized arguments: --grups (did you mean '--groups'?); --help lists the arguments",
        ),
        (
            "-m infra.launch --config_file nope.yaml recipes/pretrain_clm.py",
            "launch error: --config_file nope.yaml: no such file (accelerate_configs/ has one per engine)",
        ),
    ],
    ids=["recipe", "prepare", "tasks", "plan", "compare", "export", "replicas", "launch"],
)
def test_a_mistake_in_any_entry_point_is_one_line_and_exit_code_2(entry, line):
    proc = subprocess.run([str(BIN / "python"), *entry.split()], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr[-3000:]


def test_make_names_a_recipe_that_is_not_one_in_one_line():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}  # as typed, not in make test
    proc = subprocess.run(["make", "train", "RECIPE=pretrain"], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "RECIPE=pretrain is not a recipe: expected one of dpo_clm" in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and not proc.stdout
