"""What a recipe script calls around the Trainer: its data opened and checked, the Accelerator, the pretrained model,
and the entry point that turns every exit into a code for the launcher.

    data = open_data(data_args, args)                      # the prepared shards, split for eval
    accelerator = start(args)                              # the launcher's Accelerator, seeded
    model = load_pretrained(AutoModel..., name, hint)      # or the recipe's own
    train(accelerator, args, data_args, config, Job(...))  # infra.trainer

A bad input raises a typed error (infra.errors) before anything is written; `run_recipe`, the entry point, says it in
one line and exits with 1.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers.trainer_utils import enable_full_determinism

from infra.accelerator import build_accelerator
from infra.config import require
from infra.data import Data, DataArguments, PackedDataset, check_fits_model, open_datasets
from infra.errors import ModelError, RunError, raised_as
from infra.levers import dynamo_plugin
from infra.memory import parameter_count
from infra.metrics import flops_per_token
from infra.tracking import run_status

if TYPE_CHECKING:
    from infra.arguments import TrainingArguments


def open_data(
    data_args: DataArguments,
    args: TrainingArguments,
    fields: tuple[str, ...] = ("input_ids",),
    made_by: str = "make data",
    optional: tuple[str, ...] = (),
) -> Data:
    """The recipe's prepared shards, split (infra.data.opened): sha256 now only if no preflight will hash them."""
    preflight_hashes = (args.preflight or args.preflight_only) and (data_args.verify_data_checksums or args.preflight_only)
    return open_datasets(data_args, preflight_hashes, fields, made_by, optional)


def causal_lm_flops(model: torch.nn.Module, dataset: PackedDataset, eos_token_id: int) -> float:
    """Check that the token data fits the causal LM (vocabulary, positions, EOS: DataError); then its training FLOPs per
    token, counted before ZeRO-3 partitions the parameters."""
    check_fits_model(dataset.index, eos_token_id, model.config)
    c = model.config
    return flops_per_token(parameter_count(model), c.num_hidden_layers, c.hidden_size, dataset.seq_len)


ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2")


@dataclass
class AttentionArguments:
    """The attention kernel of a recipe's transformers model: its ModelArguments inherit this (and call its checks
    from their own __post_init__)."""

    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention kernel: sdpa, eager, flex_attention (CUDA GPUs: it has no backward on CPU), or flash_attention_2 "
            "(a CUDA GPU and the flash-attn package); None: transformers' default for the model (sdpa where the model has it). "
            "Recorded as an MLflow tag."
        },
    )

    def __post_init__(self):
        name = self.attn_implementation
        if name is None:
            return
        require(name in ATTENTION, "attn_implementation", name, f"one of {', '.join(ATTENTION)} (or null)")
        if name == "flex_attention":  # torch 2.13: "FlexAttention does not support backward on CPU"
            require(torch.cuda.is_available(), "attn_implementation", name, "a kernel that trains here: flex_attention needs a CUDA GPU")
        if name == "flash_attention_2":
            from transformers.utils import is_flash_attn_2_available

            accepted = "an installed kernel: flash_attention_2 needs a CUDA GPU and the flash-attn package; sdpa runs anywhere"
            require(is_flash_attn_2_available(), "attn_implementation", name, accepted)


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The tokens a causal LM's loss counts (its `items`): each sample's labels after the first that are not -100
    (transformers shifts the labels by one inside the model)."""
    return (labels[..., 1:] != -100).sum()


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's summed token loss and its predicted tokens, as a causal LM's loss counts them (labels shifted by
    one, -100 ignored, in fp32): for the loss per source of a data_mixture. No gradient."""
    with torch.no_grad():
        shifted = labels[:, 1:]
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), shifted, ignore_index=-100, reduction="none")
        return losses.sum(dim=1), (shifted != -100).sum(dim=1).float()


def class_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's cross-entropy (in fp32) and a count of one, as a classifier's loss counts them: for the loss per
    source of a data_mixture. No gradient."""
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none"), torch.ones_like(labels, dtype=torch.float)


def run_recipe(main: Callable[[], int | None]) -> NoReturn:
    """A recipe's entry point: main() under `run_status`, then the exit code main() returned (0 at the end or after a
    preemption, 75 for a straggler), or 1 with the one line of a RunError (infra.errors), without the interpreter's
    finalization.

    Why: after a clean finish (process group destroyed, files committed, MLflow run ended), a rank
    sometimes aborted in C++ static destructors at exit ("terminate called without an active
    exception", SIGABRT, no Python frame left: 1 launch in 20 to 40 here, with torch 2.13 and gloo),
    which turned a finished job into a failed one. So the process exits as Python would (threading's
    exit hooks, other threads joined, atexit handlers run, streams flushed) and then skips the C++ teardown. A bug's
    exception propagates and exits the usual way, with its traceback.

    Once main() has returned, the exit code is decided: a SIGTERM or SIGUSR1 from then on ends the process with that
    code at once. Torch elastic's agent stops every rank still running as soon as one exits nonzero, so at an agreed
    exit (75 for a straggler) the rank still in its exit handlers (the main process, whose MLflow client joins its
    threads) was stopped by it and reported as killed (143) instead of with the code every rank agreed on.
    """
    try:
        with run_status():
            code = main() or 0
    except RunError as err:
        print(err.line(), file=sys.stderr)
        code = 1
    except SystemExit as exit_:  # parse_config's (exit 2), as argparse's
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, lambda *_: leave(code))
    # Python's own first step of shutting down: the threading exit hooks (concurrent.futures wakes its idle workers, those
    # torch.compile's thread pool left waiting, so they end), then every other non-daemon thread joined. Joining them
    # without the hooks hung a compiled run at exit.
    threading._shutdown()
    atexit._run_exitfuncs()
    leave(code)


def leave(code: int) -> NoReturn:
    """Exit with `code` now, the streams flushed, without the interpreter's teardown."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # C stdio buffers of native libraries
    os._exit(code)


def start(args: TrainingArguments) -> Accelerator:
    """The Accelerator for the launcher's config, in the precision the recipe's mixed_precision gives here, seeded.

    A fatal signal (a segfault, an abort in C++ at exit) prints every thread's Python stack first.
    """
    faulthandler.enable(all_threads=True)
    log_with = None if args.report_to == "none" else args.report_to
    # LaunchError; ConfigError for what depends on the launch (global_batch_size against the processes started)
    accelerator, precision = build_accelerator(args, log_with, dynamo_plugin(args))
    if args.log_level != "debug":
        quiet(accelerator.is_local_main_process)
    accelerator.print(precision)
    if args.full_determinism:
        enable_full_determinism(args.seed)  # set_seed, then deterministic algorithms (and the variables GPUs need)
    else:
        set_seed(args.seed)
    return accelerator


def quiet(local_main: bool) -> None:
    """What the libraries print that a run's user need not read. MLflow's INFO lines (its store's tables made, its system
    metrics started and stopped): `MLFLOW_LOGGING_LEVEL=INFO` brings them back. accelerate's warning at every save of a
    model with tied weights ("Removed shared tensor {'lm_head.weight'} while saving ... check ... reloading"): the tie
    is made again on load, and every resume is tested bit for bit. transformers' progress bars ("Loading weights") on
    every process but one a machine. (`log_level: debug` leaves them all.)"""
    logging.getLogger("mlflow").setLevel(os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING").upper())
    logging.getLogger("accelerate.utils.other").addFilter(lambda record: "Removed shared tensor" not in record.getMessage())
    if not local_main:
        transformers.utils.logging.disable_progress_bar()


HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def model_source(name: str, hint: str, flag: str = "model_name_or_path") -> str:
    """`name` if it is an existing path or shaped like a hub id; else a ModelError naming `flag`, with `hint`."""
    if Path(name).exists() or HUB_ID.fullmatch(name):
        return name
    raise ModelError(f"{flag}={name!r} is neither an existing path nor a hub id: {hint}")


def load_pretrained(load: Callable[..., Any], name: str, hint: str, flag: str = "model_name_or_path", **kwargs) -> Any:
    """`load(name, **kwargs)` (a `from_pretrained`), or a ModelError naming the model: a name that is neither a path nor
    a hub id, a folder without the model's files, a hub id that cannot be fetched."""
    source = model_source(name, hint, flag)
    with raised_as(ModelError, OSError, ValueError):  # ValueError: a folder whose config.json names no model
        return load(source, **kwargs)
