"""The Trainer of one replica group (fault_tolerance=replicas): the quorum before every step, the step's global batch
split among the live groups, the gradients summed across them, the update only on commit, a heal from a peer.

What changes against infra.trainer.Trainer, and why:
- restore: the first quorum comes first. A group behind the live ones (started late, or back after a fault) heals from
  a peer and reads no checkpoint; when every group of the quorum starts at step 0 (a new job, or one back after losing
  every group) each loads the newest checkpoint, as a plain job does, and the quorum goes on from its step.
- step: the global batch is `global_batch_size` samples at the cursor; this group's share, by its rank in the quorum,
  is cut into micro-batches of at most per_device_train_batch_size. The item count and the gradients are summed over
  the quorum, so the update is the fault-free run's whatever the split (up to the order of the sums). A step whose
  commit fails is done again on the same samples by the next quorum; the cursor moves on commit only.
- save, export: by the group of rank 0 in the quorum, into the shared output_dir; each group's own files (its lock,
  goodput, sample trace, MLflow run id) go to OUTPUT_DIR/replicas/<id>.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from infra.data.steps import GlobalBatches
from infra.hangs import SILENT_AFTER
from infra.replicas.quorum import ReplicaGroup, Seat, as_parts, digest, from_part
from infra.shares import process_share
from infra.trainer import StepResult, Trainer, to_device


class ReplicaTrainer(Trainer):
    def __init__(self, accelerator, args, data_args, config, job, hooks=None):
        super().__init__(accelerator, args, data_args, config, job, hooks)
        self.units_per_step = args.global_batch_size * job.units_per_sample
        self.global_batches = GlobalBatches(job.data.train, args.seed, data_args.shuffle_window, args.global_batch_size)
        self.group = ReplicaGroup(accelerator, args, self.replica_state, self.load_replica_state)
        self.seat: Seat | None = None  # the quorum of the step under way (the first one's is taken in restore)
        self.seat_rank = 0  # this group's rank in the quorum of the last step: rank 0 saves and exports
        self.redone = 0  # steps that did not commit and were done again
        self.short = False  # the last quorum had fewer than min_replicas groups
        self.live, self.quorum_id = 0, -1  # the quorum of the last committed step: its groups, its number
        self.costs: dict[str, float] = {}  # the last step's: seconds of its sum across groups and commit, this process's samples
        self.heals: list[tuple[int, float]] = []  # (step healed to, seconds), to log
        # Inside a step a rank may wait on the other groups for up to replica_timeout_seconds (a sum, the commit), and
        # torchft can keep its stamp thread from running meanwhile: the group's own watchdog allows for that before it
        # takes a silent rank of the group for lost. The other groups leave this one out after that timeout anyway.
        self.watchdog.floor = 2 * args.replica_timeout_seconds + SILENT_AFTER

    @property
    def own_dir(self) -> str:
        return f"{self.args.output_dir}/replicas/{self.args.replica_group_id}"

    # -- the state a group heals from ------------------------------------------------------------------------------

    def replica_state(self) -> dict:
        """Everything a healing group needs to train on as this one (called by torchft between two steps); under FSDP
        this process's parts of the sharded weights and moments."""
        return as_parts(
            {
                "model": self.accelerator.unwrap_model(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "cursor": self.cursor.state_dict(),
                "train": self.state.state_dict(),
                "metrics": dict(self.latest),
            }
        )

    def load_replica_state(self, state: dict) -> None:
        model = self.accelerator.unwrap_model(self.model)
        ours = model.state_dict()
        model.load_state_dict({k: from_part(v, ours[k]) for k, v in state["model"].items()})
        params = [p for group in self.optimizer.param_groups for p in group["params"]]  # the optimizer state's numbering
        moments = {i: {k: from_part(v, params[i]) for k, v in s.items()} for i, s in state["optimizer"]["state"].items()}
        self.optimizer.load_state_dict({**state["optimizer"], "state": moments})
        self.scheduler.load_state_dict(state["scheduler"])
        self.cursor.load_state_dict(state["cursor"])
        self.state.load_state_dict(state["train"])
        self.latest = dict(state["metrics"])

    # -- the phases of the Trainer, for a group --------------------------------------------------------------------

    def restore(self) -> tuple[str | None, dict]:
        """The first quorum; a heal from a live group, or (every group fresh) the newest checkpoint."""
        self.seat = self.join_quorum()
        if self.seat.healed_from is not None:
            return f"a live replica group ({self.seat.seconds:.1f}s)", {"metrics": self.latest}
        path, manifest = super().restore()
        self.group.set_step(self.state.step)
        # this group's own MLflow run and goodput ledger, not those of the group that saved
        return path, {k: v for k, v in manifest.items() if k not in ("mlflow_run_id", "goodput")}

    def join_quorum(self) -> Seat:
        """The quorum of the next step; a group behind the others gets their state here."""
        seat = self.group.quorum()
        if seat.healed_from is not None:
            self.heals.append((seat.healed_from, seat.seconds))
            self.hooks.on_state("healed", self.state.step, self.model, self.optimizer)
        return seat

    def start_line(self, path: str | None) -> str:
        acc, args, seat = self.accelerator, self.args, self.seat
        where = f"resumed at step {self.state.step} from {path}" if path else "starting fresh"
        return (
            f"replica group {args.replica_group_id}: {acc.num_processes} process{'es' if acc.num_processes > 1 else ''} "
            f"({acc.distributed_type.value}), {seat.size} group{'s' if seat.size > 1 else ''} live, {where}, "
            f"{args.global_batch_size} samples per step split among the live groups"
            f"{f' (the first {args.training_replicas}; the others hot spares)' if args.training_replicas else ''}, {self.cursor}"
        )

    def step(self) -> StepResult:
        """One committed optimizer step: quorum, this group's share, the sums across groups, commit; done again on the
        same samples until a quorum commits it."""
        while True:
            if self.seat is None:
                with self.watchdog.relaxed("the quorum"):  # bounded by quorum_timeout_seconds
                    self.seat = self.join_quorum()
                if self.seat.healed_from is not None:  # it was behind the others (frozen, cut off)
                    self.bar.n = self.state.step
            seat, self.seat = self.seat, None
            result = self.attempt(seat)
            if result is not None:
                self.short = False
                return result
            if seat.size < self.args.min_replicas:  # a quorum the commit refuses (the lighthouse's min_replicas is lower)
                if not self.short:
                    live = f"{seat.size} group{'s' if seat.size > 1 else ''} live"
                    self.say(f"{live}, fewer than min_replicas={self.args.min_replicas}: waiting for more")
                self.short = True
                time.sleep(1.0)  # not a loop of quorums as fast as the lighthouse answers
                continue
            self.redone += 1
            self.say(f"step {self.state.step + 1} did not commit ({self.group.why_not()}): done again on the same samples")
            self.tracker.log({"ft/steps_redone": self.redone}, step=self.state.step + 1, again=True)

    def attempt(self, seat: Seat) -> StepResult | None:
        """One try at the next step with this quorum: None if it did not commit (nothing of it kept)."""
        acc, args, state = self.accelerator, self.args, self.state
        self.seat_rank = seat.rank
        self.step_started = time.monotonic()
        self.goodput.first_step()
        self.watchdog.entering("data")
        ids = self.global_batches.ids(self.cursor)
        training = seat.training(args.training_replicas)
        parts = process_share(ids, seat.rank, training, acc.process_index, acc.num_processes, args.per_device_train_batch_size)
        self.costs["ft/samples"] = sum(len(part) for part in parts)  # this process's share (a hot spare: none)
        batches = [self.read(p) if len(p) else None for p in parts]
        self.watchdog.entering("the item count's all-reduce (across replica groups)")
        items = self.count_items([b for b in batches if b is not None])
        num_items_in_batch = items / acc.num_processes  # DDP and FSDP average over this group's processes; the groups' are summed
        step_loss = self.backward(batches, num_items_in_batch, ids[:1])
        self.watchdog.entering("the gradient all-reduce (across replica groups)")
        summing = time.perf_counter()
        loss_sum = self.group.sum_gradients(self.model, step_loss * num_items_in_batch)  # over the groups, for this rank
        self.costs["ft/gradient_sum_seconds"] = time.perf_counter() - summing
        grad_norm = self.clip_gradients()
        self.hooks.before_optimizer_step(state.step + 1, self.model, grad_norm)
        self.watchdog.entering("the commit")
        committing = time.perf_counter()
        committed = self.group.commit()
        self.costs["ft/commit_seconds"] = time.perf_counter() - committing
        if not committed:
            self.optimizer.zero_grad(set_to_none=True)
            self.metrics.end_step(keep=False)  # the recipe's metrics of an attempt that did not commit
            return None
        result = self.update(loss_sum / num_items_in_batch, loss_sum, items, grad_norm)
        self.global_batches.advance(self.cursor)
        if self.trace and acc.is_main_process:  # the whole global batch: what every live group trained on
            self.trace.write(state.step, ids.tolist())
            self.trace.flush()  # a line a step: what a group killed next leaves is exactly what it committed
        self.log_quorum(seat)
        return result

    def read(self, ids: np.ndarray):
        return to_device(self.global_batches.read(ids), self.accelerator.device)

    def backward(self, batches: list, num_items_in_batch: torch.Tensor, stand_in: np.ndarray) -> torch.Tensor:
        """The forward and backward passes of this process's micro-batches (None: an empty one); their summed loss.
        In a group of several processes an empty micro-batch still runs its passes, on the `stand_in` sample with the
        loss times zero: the other processes' passes wait on this one's (DDP's gradient all-reduce on the last
        micro-batch, FSDP's gathers on every one), and it adds exact zeros."""
        acc = self.accelerator
        self.watchdog.entering("forward and backward")
        step_loss = torch.zeros((), device=acc.device)
        for i, batch in enumerate(batches):
            if batch is None and acc.num_processes == 1:
                continue
            last = i == len(batches) - 1
            with acc.no_sync(self.model) if acc.num_processes > 1 and not last else contextlib.nullcontext():
                if batch is None:
                    acc.backward(self.job.loss(self.model, self.read(stand_in), num_items_in_batch).loss * 0)
                    continue
                with self.stragglers.compute():
                    loss = self.micro_loss(batch, num_items_in_batch)
                    loss = self.hooks.on_loss(loss, self.state.step * len(batches) + i + 1)
                acc.backward(loss)
            step_loss += loss.detach()
        return step_loss

    def count_items(self, batches) -> torch.Tensor:
        """This group's items, summed over the quorum's groups."""
        if not batches:  # a share of nothing: more slots than samples
            items = torch.zeros((), device=self.accelerator.device)
            if self.accelerator.num_processes > 1:
                torch.distributed.all_reduce(items)
        else:
            items = super().count_items(batches)
        return self.group.sum(items.reshape(1)).reshape(())

    def log_quorum(self, seat: Seat) -> None:
        """The quorum of a committed step: its size at every step, a change and a heal said in a line."""
        spares = seat.size - seat.training(self.args.training_replicas)
        metrics = {"ft/replicas": seat.size, "ft/spares": spares, "ft/quorum_seconds": seat.seconds, **self.costs}
        if seat.id != self.quorum_id:  # another group left or joined (the same number of groups, maybe)
            if self.live:
                live = f"{seat.size} group{'s' if seat.size > 1 else ''} live (were {self.live}) from step {self.state.step}"
                self.say(live + (f", {spares} of them hot spare{'s' if spares != 1 else ''}" if self.args.training_replicas else ""))
            self.live, self.quorum_id = seat.size, seat.id
        for step, seconds in self.heals:
            self.group.tell(f"healed from a live group to step {step} in {seconds:.1f}s (xxh3 {self.group.loaded_digest})")
            metrics |= {"ft/heal_seconds": seconds}
        self.heals.clear()
        self.tracker.log(metrics, step=self.state.step)

    def say(self, line: str) -> None:
        if self.accelerator.is_main_process:
            self.bar.write(f"replica group {self.args.replica_group_id}: {line}")

    def roll_back(self) -> None:
        super().roll_back()
        self.group.set_step(self.state.step)

    def save(self, last: bool = False) -> None:
        """By the group of rank 0 in the quorum only: every group holds the same state."""
        if self.seat_rank == 0:
            super().save(last)
        elif self.trace:
            self.trace.flush()

    def export(self) -> None:
        """The state every live group ends with (equal everywhere, bit for bit), and the model, by the group of rank 0."""
        self.group.tell(f"final state of step {self.state.step} (xxh3 {digest(self.replica_state())})")
        if self.seat_rank == 0:
            super().export()
        else:
            self.accelerator.print(f"done: step {self.state.step}; the replica group of rank 0 exports the model")

    def close(self, stop: dict | None) -> int:
        self.group.shutdown()
        return super().close(stop)
