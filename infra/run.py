"""`train`, what every recipe calls last: the Trainer for its flags built on every rank, and run.

    return train(accelerator, args, data_args, config, Job(...))   # the exit code for the launcher

Its own module, above infra.trainer and infra.replicas.combine (how a replica group's steps are combined), so that
neither imports the other.
"""

from __future__ import annotations

from accelerate import Accelerator

from infra.arguments import TrainingArguments
from infra.data import DataArguments
from infra.distributed import LaunchError
from infra.job import Job
from infra.replicas import launch_problem
from infra.replicas.combine import QuorumSum
from infra.testing import hooks_from_env
from infra.trainer import Trainer


def train(accelerator: Accelerator, args: TrainingArguments, data_args: DataArguments, config: dict, job: Job) -> int:
    """Build the Trainer and run it; called on every rank by each recipe, which returns the exit code it gives. Test
    hooks come from the environment (infra.testing): none in a normal run."""
    combine = None  # the engine's own sum (infra.combine)
    if args.fault_tolerance == "replicas":
        if problem := launch_problem(args, accelerator.distributed_type.name):
            raise LaunchError(problem)
        combine = QuorumSum()  # and across the quorum of replica groups
    return Trainer(accelerator, args, data_args, config, job, hooks=hooks_from_env(accelerator.process_index), combine=combine).run()
