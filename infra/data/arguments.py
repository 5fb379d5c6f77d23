"""The data flags every recipe that trains on prepared shards shares (part of its command line and YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from infra.config import ConfigError, require
from infra.data.mixture import parse_sources


@dataclass
class DataArguments:
    """Data flags of the recipes that train on prepared shards."""

    data_dir: str = field(default="data/stdlib", metadata={"help": "Prepared shards (each recipe's YAML names its own)."})
    eval_samples: int = field(
        default=0, metadata={"help": "Hold out the last N samples of data_dir for eval (every eval_steps and at the end); 0: no eval."}
    )
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank."})
    shuffle_window: int = field(
        default=1 << 18, metadata={"help": "Samples shuffled together after the shards are shuffled (see infra.data.loader.EpochOrder)."}
    )
    verify_data_checksums: bool = field(
        default=False, metadata={"help": "sha256 every shard before training (in the preflight, on rank 0; make doctor always does)."}
    )
    trace_samples: bool = field(
        default=False,
        metadata={"help": "Log each step's global sample ids (with a mixture, their sources too) to OUTPUT_DIR/trace/rank{r}.jsonl."},
    )
    data_mixture: list[str] | None = field(
        default=None,
        metadata={
            "help": "Several prepared datasets at set proportions, instead of data_dir: items name=...,data_dir=...,weight=... "
            "(or samples=... or epochs=... per global epoch; in YAML a list of {name, data_dir, weight}); see infra.data.mixture."
        },
    )
    new_mixture_segment: bool = field(
        default=False,
        metadata={"help": "On a resume with another data_mixture: go on from the checkpoint's position with the new one (else refused)."},
    )

    def __post_init__(self):
        if self.data_mixture:
            try:
                parse_sources(self.data_mixture)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        require(self.num_workers >= 0, "num_workers", self.num_workers, "an integer >= 0")
        require(self.eval_samples >= 0, "eval_samples", self.eval_samples, "an integer >= 0")
        require(self.shuffle_window >= 1, "shuffle_window", self.shuffle_window, "an integer >= 1")
