"""Training that goes on when a replica group dies: replica-level fault tolerance over torchft.

A replica group is one Accelerate job (one or more processes, one host in practice) holding a whole copy of the model:
replicated over its processes (DDP) or sharded among them (FSDP2; with the groups, HSDP: sharded inside a group,
replicated across groups). Every group runs the same number of processes: process k of each group sums its gradients
with process k of the others, and heals from it.

Several groups train together: a lighthouse (`python -m infra.replicas lighthouse`) agrees on a quorum of the live
groups before every step, the gradients are summed across the quorum only, and the optimizer steps only when the step
commits. A group that dies is left out of the next quorum; one that starts (or comes back) heals from a live
peer, weights, optimizer, schedule, counters and data position, without reading the shared checkpoint.

Data: every step trains on the global batch the one cursor gives (`global_batch_size` samples); the live groups split
it among themselves by the quorum, so every committed step trains on the samples of a fault-free run, none twice, none
dropped, and the cursor moves only when a step commits. A step that does not commit is done again, on the same
samples, by the next quorum.

    ReplicaConfig   the flags (a section of TrainingArguments)
    launch_problem  what cannot run with them, in one line
    quorum          the torchft Manager of this group: quorum, sums across groups, commit, heal
    combine         QuorumSum: how a group's steps are combined with the others' (infra.combine), its restore,
                    save and export
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from infra.config import require

MODES = ("none", "replicas")
REPLICA_ID = re.compile(r"[A-Za-z0-9_.-]*[0-9]")  # torchft numbers a group's ranks from the id's trailing digits


@dataclass
class ReplicaConfig:
    """Fault tolerance across replica groups (part of TrainingArguments); see infra.replicas."""

    _argument_group_name = "replica groups"  # its heading in --help

    fault_tolerance: str = field(
        default="none",
        metadata={
            "help": "replicas: this launch is one replica group of several that train together and go on when one dies "
            "(torchft); needs global_batch_size and a lighthouse. none: a fault stops the job (restarts resume it)."
        },
    )
    replica_group_id: str = field(
        default="",
        metadata={"help": "This replica group's id, ending in a number (0, 1, node7); default: $REPLICA_GROUP_ID."},
    )
    lighthouse: str = field(
        default="",
        metadata={"help": "The lighthouse's address, http://HOST:PORT (python -m infra.replicas lighthouse); default: $TORCHFT_LIGHTHOUSE"},
    )
    min_replicas: int = field(default=1, metadata={"help": "Replica groups a step needs to commit (more: the step waits)."})
    training_replicas: int = field(
        default=0,
        metadata={
            "help": "Replica groups that train at each step (0: every live group). The other live groups are hot spares: "
            "they take part in every step's sums with nothing of their own and step with the others, so a spare takes a "
            "lost group's share of the global batch at the next step, with no heal and no step slower than before."
        },
    )
    replica_timeout_seconds: float = field(
        default=30.0,
        metadata={
            "help": "How long a replica group waits on the others in a step (the gradient sum, the commit, a heal's "
            "transfer): a frozen or cut-off group is left out after this."
        },
    )
    quorum_timeout_seconds: float = field(
        default=120.0, metadata={"help": "How long a step waits for a quorum of min_replicas groups before the run stops."}
    )

    def __post_init__(self):
        require(self.fault_tolerance in MODES, "fault_tolerance", self.fault_tolerance, " or ".join(MODES))
        if self.fault_tolerance != "replicas":
            return
        self.replica_group_id = self.replica_group_id or os.environ.get("REPLICA_GROUP_ID", "")
        self.lighthouse = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        accepted = "letters, digits, '_', '-' or '.', ending in a digit (or set $REPLICA_GROUP_ID)"
        require(bool(REPLICA_ID.fullmatch(self.replica_group_id)), "replica_group_id", self.replica_group_id, accepted)
        url = re.fullmatch(r"https?://[^/:]+:\d+/?", self.lighthouse)
        require(bool(url), "lighthouse", self.lighthouse, "http://HOST:PORT (or set $TORCHFT_LIGHTHOUSE)")
        require(self.min_replicas >= 1, "min_replicas", self.min_replicas, "an integer >= 1")
        require(self.training_replicas >= 0, "training_replicas", self.training_replicas, "an integer >= 0 (0: every live group)")
        require(self.replica_timeout_seconds > 0, "replica_timeout_seconds", self.replica_timeout_seconds, "a number > 0")
        require(self.quorum_timeout_seconds > 0, "quorum_timeout_seconds", self.quorum_timeout_seconds, "a number > 0")


def launch_problem(args, engine: str | None) -> str | None:
    """Why fault_tolerance=replicas cannot run on this engine, in one line (None if it can)."""
    if args.fault_tolerance != "replicas":
        return None
    if engine == "DEEPSPEED":
        return (
            "fault_tolerance=replicas cannot run on DeepSpeed ZeRO: its one engine spans every process, so no replica group "
            "can leave or join alone; use a DDP or FSDP config (accelerate_configs/cpu.yaml, ddp.yaml, fsdp.yaml)"
        )
    return None
