"""`--help` of every entry point a user types: each recipe and each `python -m infra...` tool prints its usage and exits 0
(a `%` in a help text once made every recipe's `--help` a traceback: argparse reads it as a format code)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import BIN, REPO

RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.py"))
TOOLS = ["infra.compare", "infra.export", "infra.launch", "infra.plan", "infra.data.prepare", "infra.data.tasks", "infra.replicas"]


@pytest.mark.parametrize("entry", [f"recipes/{r}" for r in RECIPES] + [f"-m {t}" for t in TOOLS])
def test_every_entry_point_prints_its_help(entry):
    proc = subprocess.run([str(BIN / "python"), *entry.split(), "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage:") and "Traceback" not in proc.stderr, proc.stdout[:500] + proc.stderr[-2000:]
    if entry.startswith("recipes/"):
        assert "--config" in proc.stdout and "--output_dir" in proc.stdout and "5% of" in proc.stdout
