"""Precision: `auto` follows the hardware, a forced value wins, and the launcher may only agree with the recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from infra import precision
from infra.precision import PrecisionError, resolve
from tests.conftest import REPO


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(precision.LAUNCHER_ENV, raising=False)


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """bf16_speedup replaced by a given figure; the calls counted; the cache in tmp_path."""
    monkeypatch.setenv(precision.PROBE_CACHE_ENV, str(tmp_path / "probe.json"))
    measured = {"speedup": 1.0, "calls": 0}

    def fake() -> float:
        measured["calls"] += 1
        return measured["speedup"]

    monkeypatch.setattr(precision, "bf16_speedup", fake)
    return measured


@pytest.mark.parametrize(
    ("native", "amx", "speedup", "expected"),
    [
        (False, False, 2.0, "no"),
        (True, True, 0.5, "bf16"),
        (True, False, 1.16, "bf16"),
        (True, False, 1.02, "no"),
        (True, False, 0.78, "no"),
    ],
)
def test_auto_is_bf16_where_the_cpu_computes_it_faster(cpu_only, monkeypatch, probe, native, amx, speedup, expected):
    """Emulated bf16: fp32 without a probe. AMX: bf16 without a probe. AVX-512-BF16 alone: the probe decides, with a
    margin (the AMD EPYC here ran the default pretraining 1.16x as fast in bf16; an Intel Xeon of the kind 0.78x)."""
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    probe["speedup"] = speedup
    chosen = resolve("auto")
    assert chosen.value == expected and chosen.reason.startswith("auto: ")
    assert probe["calls"] == (native and not amx)
    if probe["calls"]:
        assert f"bf16 ran a probe of a decoder block {speedup:.2f}x as fast as fp32" in chosen.reason
    for forced in ("bf16", "fp16", "no"):  # a forced value wins whatever the hardware, and measures nothing
        assert resolve(forced).value == forced
    assert probe["calls"] == (native and not amx)


def test_the_probe_runs_once_per_machine_and_every_process_takes_its_answer(cpu_only, monkeypatch, probe, tmp_path):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    probe["speedup"] = 1.3
    assert resolve("auto").value == "bf16"
    probe["speedup"] = 0.5  # a second measure would say fp32: it is not taken
    assert resolve("auto").value == "bf16" and probe["calls"] == 1
    cached = json.loads((tmp_path / "probe.json").read_text())
    (key,) = cached
    assert cached[key] == 1.3 and precision.cpu_description() in key and torch.__version__ in key
    # another number of threads is another machine to the probe
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert resolve("auto").value == "no" and probe["calls"] == 2


def test_a_cache_that_cannot_be_written_measures_without_keeping(cpu_only, monkeypatch, probe, tmp_path):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(precision.PROBE_CACHE_ENV, str(tmp_path / "a_file" / "probe.json"))  # its folder is a file
    probe["speedup"] = 1.3
    assert resolve("auto").value == "bf16" and resolve("auto").value == "bf16" and probe["calls"] == 2


def test_the_probe_measures_both_precisions(cpu_only):
    """The real probe: a positive ratio, in seconds (bf16 there is native or emulated, whatever the CPU)."""
    start = time.monotonic()
    assert precision.bf16_speedup(repeats=1) > 0
    assert time.monotonic() - start < 60


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
