"""Precision: `auto` follows the hardware, a forced value wins, and the launcher may only agree with the recipe."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from infra import precision
from infra.precision import PrecisionError, resolve
from tests.conftest import REPO


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(precision.LAUNCHER_ENV, raising=False)


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_only_where_the_cpu_computes_it(cpu_only, monkeypatch, native):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    chosen = resolve("auto")
    assert chosen.value == ("bf16" if native else "no")
    assert chosen.reason.startswith("auto: ")
    for forced in ("bf16", "fp16", "no"):  # a forced value wins whatever the hardware
        assert resolve(forced).value == forced


@pytest.mark.parametrize(("bf16_gpu", "expected"), [(True, "bf16"), (False, "fp16")])
def test_auto_on_gpus(monkeypatch, bf16_gpu, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100" if not bf16_gpu else "H100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_gpu)
    assert resolve("auto").value == expected


def test_the_launcher_may_only_agree(cpu_only, monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert resolve("auto", launcher="no").value == "no"  # accelerate's value when nothing was asked
    assert resolve("bf16", launcher="bf16").value == "bf16"
    with pytest.raises(PrecisionError, match=r"launcher asks for mixed_precision=bf16 .* recipe's mixed_precision=auto gives no here"):
        resolve("auto", launcher="bf16")
    with pytest.raises(PrecisionError, match="pass --mixed_precision fp16 to the recipe"):
        resolve("bf16", launcher="fp16")
    monkeypatch.setenv(precision.LAUNCHER_ENV, "fp16")  # what accelerate launch sets from its config file
    with pytest.raises(PrecisionError):
        resolve("no")


def test_torch_limited_to_avx2_counts_as_no_native_bf16():
    """ATEN_CPU_CAPABILITY=avx2 is how an AVX2-only CPU looks to torch: auto must give fp32 there."""
    code = "from infra.precision import cpu_has_native_bf16 as f; print(f())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_launcher_that_disagrees_stops_the_recipe_in_one_line(tiny_data, tmp_path):
    """accelerate_configs/ set no precision; a user's own config with `mixed_precision: fp16` meets a recipe forcing bf16."""
    config = tmp_path / "old.yaml"
    config.write_text('compute_environment: LOCAL_MACHINE\ndistributed_type: "NO"\nnum_processes: 1\nmixed_precision: fp16\n')
    out = tmp_path / "out"
    recipe = [
        str(REPO / "recipes" / "pretrain_clm.py"),
        "--data_dir",
        str(tiny_data),
        "--mixed_precision",
        "bf16",
        "--output_dir",
        str(out),
    ]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    cmd = [sys.executable, "-m", "infra.launch", "--config_file", str(config), *recipe]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("launch error: the launcher asks for mixed_precision=fp16"), proc.stderr
    assert not out.exists() and not (tmp_path / "mlflow.db").exists()
