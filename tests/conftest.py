"""Shared fixtures: a tiny prepared dataset and a helper that launches recipes for real."""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infra.data.tasks import PLAIN_CHAT_TEMPLATE, TaskArguments, prepare_task, stdlib_instructions, stdlib_preferences
from infra.testing import FAULTS_ENV

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


DEADLINE_ENV = "INFRA_TEST_DEADLINE"  # seconds since the epoch (.ci/run sets it): no slow or matrix test starts after it


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Past the deadline a slow or matrix test is skipped, saying so; the quick suite (`make test`) always runs whole.
    CI holds every CPU kind to one time limit, and the slowest 2-core kind it meets takes about twice as long."""
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline and time.time() > float(deadline) and ({"slow", "matrix"} & {m.name for m in item.iter_markers()}):
        pytest.skip(f"not started: {DEADLINE_ENV} has passed (CI's time on this CPU is spent): make test-slow or test-matrix runs it")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """~300 KB of the standard library, a 512-token BPE, 64-token samples."""
    from infra.data.prepare import PrepareArguments, prepare

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(PrepareArguments(output_dir=str(out), max_bytes=300_000, vocab_size=512, seq_len=64, samples_per_shard=256))
    return out


@pytest.fixture(scope="session")
def small_data(tiny_data, tmp_path_factory) -> Path:
    """~300 samples in shards of 32: the launched runs below cross epoch ends and shuffle windows."""
    from infra.data.prepare import PrepareArguments, prepare

    out = tmp_path_factory.mktemp("data") / "small"
    prepare(
        PrepareArguments(output_dir=str(out), max_bytes=40_000, tokenizer=str(tiny_data / "tokenizer"), seq_len=64, samples_per_shard=32)
    )
    return out


@pytest.fixture(scope="session")
def straight(small_data, tmp_path_factory):
    """One uninterrupted 2-process run of pretrain_clm (tests.test_pretrain's arguments, 2 x STEPS steps): what a resumed,
    restarted or multi-host run of the same steps must equal."""
    from tests.test_pretrain import STEPS, recipe_args

    tmp = tmp_path_factory.mktemp("straight")
    proc = launch("cpu.yaml", recipe_args(small_data, tmp / "out", 2 * STEPS), tmp)
    assert proc.returncode == 0
    return tmp, proc


PORTS = 20000, 2000  # the first port of the blocks handed out below the kernel's ephemeral range (32768 up), and a block's size
_next_port = itertools.count(random.randrange(PORTS[1]))


def free_port() -> int:
    """A port nobody listens on, for a launch's rendezvous, from this pytest process's own block below the kernel's
    ephemeral ports: neither another process of `pytest -n` nor an outgoing connection (which takes an ephemeral port)
    can take it between this check and the launcher's bind, and a process never hands out the same one twice in a row."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ...: pytest-xdist's processes
    first = PORTS[0] + PORTS[1] * (int(worker[2:]) % 6)
    for _ in range(PORTS[1]):
        port = first + next(_next_port) % PORTS[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or closed a moment ago
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORTS[1] - 1}")


@functools.cache
def empty_store() -> Path:
    """One MLflow sqlite store with its schema and nothing in it, made once a session (removed at its end)."""
    import atexit
    import tempfile

    import mlflow

    folder = Path(tempfile.mkdtemp(prefix="infra-tests-mlflow-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    store = folder / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{store}").search_experiments()
    return store


def tracking_uri(folder: Path) -> str:
    """The MLflow store of a test's launches, `folder/mlflow.db`: a copy of the empty store unless the folder has its
    store already. A new sqlite store runs MLflow's schema migrations, 3 to 10 s of a core, which each launched test
    would otherwise pay; the copy is the same database."""
    store = folder / "mlflow.db"
    if not store.exists():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(empty_store(), store)
    return f"sqlite:///{store}"


def launch_command(
    accelerate_config: str,
    recipe_args: list[str],
    tmp_path: Path,
    recipe: str = "pretrain_clm",
    num_processes: int = 2,
    launcher_args: tuple[str, ...] = (),
    launcher: tuple[str, ...] = (str(BIN / "accelerate"), "launch"),
    port: int | None = None,
    env: dict[str, str] | None = None,
):
    """`accelerate launch --config_file accelerate_configs/X recipes/R.py ...`, as the README shows it, and its environment.

    The environment added is where MLflow writes (a store in tmp_path), and `env`.
    """
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking_uri(tmp_path), **(env or {})}
    cmd = [
        *launcher,
        "--config_file",
        str(REPO / "accelerate_configs" / accelerate_config),
        "--num_processes",
        str(num_processes),
        "--main_process_port",
        str(port or free_port()),
        *launcher_args,
        str(REPO / "recipes" / f"{recipe}.py"),
        *recipe_args,
    ]
    return cmd, env


def run_launch(cmd: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    """Run a launch; if it outlives `timeout`, fail with every process's Python stack and the process tree.

    The launch gets its own process group: on a timeout the launcher and its workers get SIGABRT
    (PYTHONFAULTHANDLER prints each one's stacks), then SIGKILL, so no worker outlives the test.
    """
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = subprocess.run(["ps", "-o", "pid,stat,etime,args", "--forest", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        os.killpg(proc.pid, signal.SIGABRT)
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"launch still running after {timeout} s: {' '.join(cmd)}\n{tree}\n{stdout[-3000:]}\n{stderr[-20000:]}")
    # the copies' checks (infra.sdc) and the replays (infra.replay) run at their defaults in every launch: a mismatch
    # or a transient fault nobody injected is a false alarm (a spike or a non-finite step computed again to the same
    # result is not: the data or the model, told apart from the machine)
    faults = env.get(FAULTS_ENV, "")
    if "sdc: copies disagree" in stdout and '"flip"' not in faults:
        pytest.fail(f"a false alarm of the copies' checks: {' '.join(cmd)}\n{stdout[-5000:]}")
    replays = [line for line in stdout.splitlines() if "computed again from the state before it" in line]
    injected = '"flip"' in faults or '"scale_loss"' in faults
    if any("the data or the model, not the machine" not in line for line in replays) and not injected:
        pytest.fail(f"a false alarm of the replays: {' '.join(cmd)}\n{stdout[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def launch(accelerate_config: str, recipe_args: list[str], tmp_path: Path, timeout: int = 600, num_processes: int = 2, **kw):
    cmd, env = launch_command(accelerate_config, recipe_args, tmp_path, num_processes=num_processes, **kw)
    proc = run_launch(cmd, env, timeout)
    if proc.returncode != 0:
        print(proc.stdout[-5000:], proc.stderr[-8000:], sep="\n")
    return proc


def moto_s3():
    """A started S3-compatible server (moto) on 127.0.0.1, and the environment that points boto/s3fs at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    return server, env


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server (moto) on 127.0.0.1, and the environment that points boto/s3fs at it."""
    server, env = moto_s3()
    yield env
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """This test's environment pointed at the S3 server (launched processes inherit it), with a fresh bucket and cache."""
    import fsspec

    for key, value in {**s3_server, "INFRA_DATA_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket = f"test-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    fs.mkdir(bucket)
    return fs, bucket


# Inputs of the recipes' launch tests (tests/test_recipes.py, tests/test_dpo.py): small and local


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def sft_clm_inputs(tiny_data, tmp_path_factory) -> tuple[Path, list[str]]:
    """Prompt/response pairs from the standard library as a JSONL file, and a tiny causal LM on tiny_data's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("sft")
    pairs = [{"prompt": p, "response": r} for p, r in itertools.islice(stdlib_instructions(), 160)]
    source = write_jsonl(root / "pairs.jsonl", pairs)
    data = root / "data"
    prepare_task(TaskArguments(task="sft", source=str(source), tokenizer=str(tiny_data / "tokenizer"), output_dir=str(data), seq_len=96))
    tokenizer = AutoTokenizer.from_pretrained(data / "tokenizer")
    assert tokenizer.chat_template == PLAIN_CHAT_TEMPLATE  # the trained tokenizer had none: the plain one was saved with the data
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=96,
        attention_dropout=0.1,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    return data, ["--model_name_or_path", str(root / "model"), "--eval_samples", "16"]


@pytest.fixture(scope="session")
def packed_sft(sft_clm_inputs, tmp_path_factory) -> Path:
    """Short prompt/response pairs (a docstring's start -> the function's first line), prepared with --packing true."""
    data, _ = sft_clm_inputs
    root = tmp_path_factory.mktemp("sft_packed")
    pairs = [{"prompt": p[:24], "response": r.splitlines()[0][:32]} for p, r in itertools.islice(stdlib_instructions(), 300)]
    source = write_jsonl(root / "pairs.jsonl", pairs)
    out = root / "data"
    prepare_task(
        TaskArguments(task="sft", source=str(source), tokenizer=str(data / "tokenizer"), output_dir=str(out), seq_len=96, packing=True)
    )
    return out


@pytest.fixture(scope="session")
def sft_without_dropout(sft_clm_inputs, tmp_path_factory) -> tuple[Path, Path]:
    """The SFT data, and its tiny model with dropout off (so that gradients depend on the data alone)."""
    from transformers import AutoModelForCausalLM

    data, args = sft_clm_inputs
    model = AutoModelForCausalLM.from_pretrained(args[args.index("--model_name_or_path") + 1])
    model.config.attention_dropout = 0.0
    folder = tmp_path_factory.mktemp("sft_no_dropout") / "model"
    model.save_pretrained(folder)
    return data, folder


def stdlib_triples(n: int) -> list[dict]:
    """The first n preference triples of the default DPO data, as rows of a table."""
    return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in stdlib_preferences(limit=n)]


@pytest.fixture(scope="session")
def dpo_clm_inputs(sft_clm_inputs, tmp_path_factory) -> tuple[Path, list[str]]:
    """Preference triples from the standard library as JSONL, prepared with the SFT data's tokenizer; SFT's tiny model."""
    sft_data, args = sft_clm_inputs
    root = tmp_path_factory.mktemp("dpo")
    source = write_jsonl(root / "triples.jsonl", stdlib_triples(160))
    data = root / "data"
    prepare_task(TaskArguments(task="dpo", source=str(source), tokenizer=str(sft_data / "tokenizer"), output_dir=str(data), seq_len=96))
    return data, args
