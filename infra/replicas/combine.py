"""How a replica group's step is combined with the other groups' (fault_tolerance=replicas): the quorum before every
try at a step, the gradients summed across the live groups, the update only on commit, a heal from a peer. The Trainer's
step and phases are the plain job's (infra.trainer); what changes is this combine (infra.combine says its calls) and the
reader of the step's samples (infra.data.steps.SplitShares).

- restore: the first quorum comes first. A group behind the live ones (started late, or back after a fault) heals from
  a peer and reads no checkpoint; when every group of the quorum starts at step 0 (a new job, or one back after losing
  every group) each loads the newest checkpoint, as a plain job does, and the quorum goes on from its step.
- step: the global batch is `global_batch_size` samples at the cursor; this group's share, by its rank in the quorum,
  is cut into micro-batches of at most per_device_train_batch_size. The item count and the gradients are summed over
  the quorum, so the update is the fault-free run's whatever the split (up to the order of the sums). A step whose
  commit fails is done again on the same samples by the next quorum; the cursor moves on commit only.
- save, export: by the group of rank 0 in the quorum, into the shared output_dir; each group's own files (its lock,
  goodput, sample trace, MLflow run id) go to OUTPUT_DIR/replicas/<id> (TrainingArguments.own_dir).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from infra.hangs import SILENT_AFTER
from infra.health import DesyncError
from infra.replicas.copies import GroupCopies
from infra.replicas.pace import Decision, GroupPace
from infra.replicas.quorum import ReplicaGroup, as_parts, digest, from_part
from infra.shares import Seat
from infra.stopped import Reason, Stop


class QuorumSum:
    """infra.combine's calls for a replica group: `bind` builds its torchft Manager (infra.replicas.quorum)."""

    items_where = "the item count's all-reduce (across replica groups)"
    backward_where = "forward and backward"

    def __init__(self):
        self.seat: Seat | None = None  # the quorum of the try under way (the first one's is taken in restore)
        self.seat_rank = 0  # this group's rank in the quorum of the last step: rank 0 saves and exports
        self.redone = 0  # steps that did not commit and were done again
        self.short = False  # the last quorum had fewer than min_replicas groups
        self.live, self.quorum_id = 0, -1  # the quorum of the last committed step: its groups, its number
        self.costs: dict[str, float] = {}  # the last step's: seconds of its sum across groups and commit
        self.heals: list[tuple[int, float]] = []  # (step healed to, seconds), to log
        self.pace: GroupPace | None = None  # the groups' shares after their speeds (straggler_action: rebalance)
        self.counted = (0.0, 0.0)  # when the try's count across the groups began and ended (perf_counter)
        self.leaving: Stop | None = None  # this group's stop, once rebalancing cannot keep up with it (or it computes wrong)
        self.found: list[int] = []  # the groups (quorum ranks) whose copies of the state differed in this try
        self.times_named = 0  # how often this group's copy was found apart from the others'

    def bind(self, trainer: Any) -> None:
        self.trainer, self.args = trainer, trainer.args
        self.group = ReplicaGroup(trainer.accelerator, trainer.args, self.replica_state, self.load_replica_state)
        # Inside a step a rank may wait on the other groups for up to replica_timeout_seconds (a sum, the commit), and
        # torchft can keep its stamp thread from running meanwhile: the group's own watchdog allows for that before it
        # takes a silent rank of the group for lost. The other groups leave this one out after that timeout anyway.
        trainer.watch.watchdog.floor = 2 * trainer.args.replica_timeout_seconds + SILENT_AFTER
        if trainer.args.straggler_action == "rebalance":
            self.pace = GroupPace(trainer.args, trainer.accelerator.num_processes)
        args = trainer.args
        self.copies = GroupCopies(trainer, args.sdc_check_steps, args.save_steps, args.sdc_action != "off")

    @property
    def saves(self) -> bool:
        """By the group of rank 0 in the quorum only: every group holds the same state (not by one that leaves it: the
        others go on, and the next rank 0 saves)."""
        return self.seat_rank == 0 and self.leaving is None

    # -- the state a group heals from ------------------------------------------------------------------------------

    def replica_state(self) -> dict:
        """Everything a healing group needs to train on as this one (called by torchft between two steps); under FSDP
        this process's parts of the sharded weights and moments."""
        t = self.trainer
        return as_parts(
            {
                "model": t.accelerator.unwrap_model(t.model).state_dict(),
                "optimizer": t.optimizer.state_dict(),
                "scheduler": t.scheduler.state_dict(),
                "cursor": t.cursor.state_dict(),
                "train": t.state.state_dict(),
                "metrics": dict(t.latest),
            }
        )

    def load_replica_state(self, state: dict) -> None:
        t = self.trainer
        model = t.accelerator.unwrap_model(t.model)
        ours = model.state_dict()
        model.load_state_dict({k: from_part(v, ours[k]) for k, v in state["model"].items()})
        params = [p for group in t.optimizer.param_groups for p in group["params"]]  # the optimizer state's numbering
        moments = {i: {k: from_part(v, params[i]) for k, v in s.items()} for i, s in state["optimizer"]["state"].items()}
        t.optimizer.load_state_dict({**state["optimizer"], "state": moments})
        t.scheduler.load_state_dict(state["scheduler"])
        t.cursor.load_state_dict(state["cursor"])
        t.state.load_state_dict(state["train"])
        t.latest = dict(state["metrics"])

    # -- the Trainer's calls (infra.combine) -----------------------------------------------------------------------

    def restore(self, load) -> tuple[str | None, dict]:
        """The first quorum; a heal from a live group, or (every group fresh) the newest checkpoint."""
        self.seat = self.join_quorum()
        if self.seat.healed_from is not None:
            self.copies.agreed_at = self.trainer.state.step  # a live group's state
            return f"a live replica group ({self.seat.seconds:.1f}s)", {"metrics": self.trainer.latest}
        path, manifest = load()
        self.copies.agreed_at = self.trainer.state.step  # every group of the quorum starts from this checkpoint
        self.group.set_step(self.trainer.state.step)
        # this group's own MLflow run and goodput ledger, not those of the group that saved
        return path, {k: v for k, v in manifest.items() if k not in ("mlflow_run_id", "goodput")}

    def join_quorum(self) -> Seat:
        """The quorum of the next step; a group behind the others gets their state here."""
        t = self.trainer
        seat = self.group.quorum()
        if seat.healed_from is not None:
            self.heals.append((seat.healed_from, seat.seconds))
            t.hooks.on_state("healed", t.state.step, t.model, t.optimizer)
        return seat

    def who(self) -> str:
        acc, seat = self.trainer.accelerator, self.seat
        return (
            f"replica group {self.args.replica_group_id}: {acc.num_processes} process{'es' if acc.num_processes > 1 else ''} "
            f"({acc.distributed_type.value}), {seat.size} group{'s' if seat.size > 1 else ''} live"
        )

    def batch(self) -> str:
        args = self.args
        spares = f" (the first {args.training_replicas}; the others hot spares)" if args.training_replicas else ""
        return f"{args.global_batch_size} samples per step split among the live groups{spares}"

    def begin(self) -> Seat:
        """The quorum of this try at the next step (the first one's came with restore)."""
        if self.seat is None:
            with self.trainer.watch.relaxed("the quorum"):  # bounded by quorum_timeout_seconds
                self.seat = self.join_quorum()
            if self.seat.healed_from is not None:  # it was behind the others (frozen, cut off)
                self.trainer.watch.bar.n = self.trainer.state.step
        seat, self.seat = self.seat, None
        self.seat_rank, self.size = seat.rank, seat.size
        return seat if self.pace is None else self.pace.seat(seat)

    def count(self, items: torch.Tensor) -> torch.Tensor:
        """This group's items, summed over the quorum's groups."""
        self.costs["ft/samples"] = self.trainer.shares.samples_read  # this process's share (a hot spare: none)
        checking = self.copies.due()
        if self.pace is None and not checking:
            return self.group.sum(items.reshape(1)).reshape(())
        # each group's numbers in its slot: its last try's pace (infra.replicas.pace), its copy (infra.replicas.copies)
        parts = [items.reshape(1).double()]
        if self.pace is not None:
            parts.append(self.pace.report(self.size).to(items.device))
        if checking:
            parts.append(self.copies.report(self.seat_rank, self.size).to(items.device))
        began = time.perf_counter()
        summed = self.group.sum(torch.cat(parts))
        self.counted = (began, time.perf_counter())
        paced = 2 * self.size if self.pace is not None else 0
        if self.pace is not None:
            self.pace.received(summed[1 : 1 + paced])
        if checking:
            self.check(summed[1 + paced :])
        return summed[0].to(items.dtype)

    def check(self, summed: torch.Tensor) -> None:
        """The groups' copies of the state compared (infra.replicas.copies): apart, this try fails to commit in every
        group, and `not_committed` mends it."""
        self.found = self.copies.received(summed)
        self.trainer.watch.log(dict(self.copies.counts), step=self.trainer.state.step)
        if self.found:
            who = ", ".join(f"group {g}{' (this one)' if g == self.seat_rank else ''}" for g in self.found)
            line = f"sdc: the replica groups' copies of the state disagree at step {self.trainer.state.step}: {who} apart"
            self.say(line + ("" if len(self.found) < self.size else " (no majority: which is wrong cannot be told)"))
            self.group.fail(line)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """The gradients of a group of several processes synced on the last micro-batch only, as accelerate does;
        `gradient_accumulation_steps` is 1 (infra.accelerator), so the loss is not divided."""
        acc = self.trainer.accelerator
        return acc.no_sync(self.trainer.model) if acc.num_processes > 1 and not last else contextlib.nullcontext()

    def gradients(self, step_loss: torch.Tensor, num_items_in_batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients and this rank's summed item losses, summed over the groups (one all-reduce)."""
        if self.pace is not None:
            self.measure()
        self.trainer.watch.entering("the gradient all-reduce (across replica groups)")
        summing = time.perf_counter()
        loss_sum = self.group.sum_gradients(self.trainer.model, step_loss * num_items_in_batch)
        self.costs["ft/gradient_sum_seconds"] = time.perf_counter() - summing
        return loss_sum / num_items_in_batch, loss_sum

    def measure(self) -> None:
        """This group's time of the try: the read and the passes, not the count's wait on the other groups; its slowest
        process's (one all-reduce inside the group), so that every process sends the same."""
        t = self.trainer
        began, ended = self.counted
        seconds = torch.tensor([(began - t.step_started) + (time.perf_counter() - ended)], device=t.accelerator.device)
        if t.accelerator.num_processes > 1:
            torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        self.pace.measured(float(seconds))

    def commit(self) -> bool:
        self.trainer.watch.entering("the commit")
        committing = time.perf_counter()
        committed = self.group.commit()
        self.costs["ft/commit_seconds"] = time.perf_counter() - committing
        return committed

    def committed(self, seat: Seat) -> None:
        """The quorum of a committed step: its size at every step, a change and a heal said in a line."""
        self.short = False
        spares = seat.size - seat.training(self.args.training_replicas)
        metrics = {"ft/replicas": seat.size, "ft/spares": spares, "ft/quorum_seconds": seat.seconds, **self.costs}
        if seat.id != self.quorum_id:  # another group left or joined (the same number of groups, maybe)
            if self.live:
                live = f"{seat.size} group{'s' if seat.size > 1 else ''} live (were {self.live}) from step {self.trainer.state.step}"
                self.say(live + (f", {spares} of them hot spare{'s' if spares != 1 else ''}" if self.args.training_replicas else ""))
            self.live, self.quorum_id = seat.size, seat.id
        for step, seconds in self.heals:
            self.group.tell(f"healed from a live group to step {step} in {seconds:.1f}s (xxh3 {self.group.loaded_digest})")
            metrics |= {"ft/heal_seconds": seconds}
        self.heals.clear()
        if self.pace is not None and (decision := self.pace.committed(self.trainer.state.step)) is not None:
            metrics |= self.paced(seat, decision)
        self.trainer.watch.log(metrics, step=self.trainer.state.step)

    def paced(self, seat: Seat, decision: Decision) -> dict[str, float]:
        """A window's decision said: a line when the shares change or a group is left out; this group's stop when it is
        the one; each training group's share and step time over the median's (shares/group_i, straggler/group_i: by rank
        in the quorum)."""
        step = self.trainer.state.step

        def name(g: int) -> str:
            return f"group {g}{' (this one)' if g == seat.rank else ''}"

        if decision.after != decision.before and step < self.args.max_steps:
            was = ", ".join(
                f"{name(g)} {a} -> {b} ({t * 1000:.1f} ms a sample)"
                for g, (a, b, t) in enumerate(zip(decision.before, decision.after, decision.per_sample, strict=True))
            )
            self.say(f"rebalanced: the step's {sum(decision.after)} samples among the training groups from step {step + 1}: {was}")
        left = len(decision.behind)
        for g, why in decision.behind.items():
            if seat.size - left < self.args.min_replicas:
                least = f"min_replicas={self.args.min_replicas}"
                self.say(f"straggler: {name(g)} cannot be kept up with ({why}); it stays: fewer than {least} groups would be left")
            elif g == seat.rank:
                self.say(f"straggler: this group cannot be kept up with ({why}); it leaves the quorum, which goes on without it")
                hosts = sorted(set(self.trainer.stragglers.hosts))
                self.leaving = Stop(Reason.STRAGGLER, hosts=tuple(hosts), replica_group=self.args.replica_group_id)
            else:
                self.say(f"straggler: {name(g)} cannot be kept up with ({why}); it leaves the quorum")
        shares = {f"shares/group_{g}": float(size) for g, size in enumerate(decision.after)}
        return shares | {f"straggler/group_{g}": ratio for g, ratio in enumerate(decision.ratios)}

    def stop(self) -> Stop | None:
        """This group's stop after a committed step: when it leaves the quorum, a straggler (infra.replicas.pace)."""
        return self.leaving

    def not_committed(self, seat: Seat) -> None:
        """A step that did not commit: with too few groups, a wait for more; else it is done again on the same samples;
        then copies found apart are mended."""
        if self.pace is not None:
            self.pace.not_committed()
        self.redo(seat)
        if self.found:
            self.mend()

    def redo(self, seat: Seat) -> None:
        """A try that did not commit, said: a wait for more groups, or the step done again."""
        if seat.size < self.args.min_replicas:  # a quorum the commit refuses (the lighthouse's min_replicas is lower)
            if not self.short:
                live = f"{seat.size} group{'s' if seat.size > 1 else ''} live"
                self.say(f"{live}, fewer than min_replicas={self.args.min_replicas}: waiting for more")
            self.short = True
            time.sleep(1.0)  # not a loop of quorums as fast as the lighthouse answers
            return
        self.redone += 1
        step = self.trainer.state.step + 1
        self.say(f"step {step} did not commit ({self.group.why_not()}): done again on the same samples")
        self.trainer.watch.log({"ft/steps_redone": self.redone}, step=step, again=True)

    def mend(self) -> None:
        """After copies found apart (infra.replicas.copies): the saving group sets aside its checkpoints since the last
        agreement when it may be the wrong one; a group apart from a majority heals from a live group at the next
        quorum (named a second time, it leaves after the next committed step); with no majority every group goes
        back to the newest checkpoint from before."""
        t, named, self.found = self.trainer, self.found, []
        majority, step, agreed = len(named) < self.size, t.state.step, self.copies.agreed_at
        suspect = self.seat_rank == 0 and (self.seat_rank in named or not majority)  # the saver may have written them wrong
        if suspect and (moved := t.checkpoints.set_aside(agreed)):
            self.say(f"sdc: set aside {', '.join(moved)} (written after the copies last agreed, at step {agreed})")
        if not majority:
            path = t.checkpoints.newest_through(agreed)
            if path is None:
                raise DesyncError(f"the replica groups' copies disagree at step {step} and no checkpoint of step {agreed} or before")
            with t.watch.relaxed("the rollback"):
                t.checkpoints.wait()
                path, manifest = t.load_checkpoint(str(path))
            t.went_back(manifest, repair=True)  # the groups' step set back with it (rolled_back)
            t.shares.start()
            self.say(f"sdc: back to {Path(path).name}; the {step - t.state.step} steps since are trained again")
        elif self.seat_rank in named:
            self.times_named += 1
            if self.times_named > 1 and self.leaving is None:
                self.say("sdc: this group's copy was apart a second time: it leaves the quorum after its next step")
                hosts = sorted(set(t.stragglers.hosts))
                ranks = list(range(t.accelerator.num_processes))
                self.leaving = Stop(Reason.SDC, hosts=tuple(hosts), replica_group=self.args.replica_group_id, ranks=tuple(ranks))
            self.say("sdc: this group heals from a live group at the next quorum")
            self.group.set_step(step - 1)  # behind the others: the quorum sends it their state

    def say(self, line: str) -> None:
        self.trainer.watch.say(f"replica group {self.args.replica_group_id}: {line}")

    def rolled_back(self) -> None:
        self.group.set_step(self.trainer.state.step)

    def export(self, export) -> None:
        """The state every live group ends with (equal everywhere, bit for bit), and the model, by the group of rank 0."""
        self.group.tell(f"final state of step {self.trainer.state.step} (xxh3 {digest(self.replica_state())})")
        if self.seat_rank == 0:
            export()
        else:
            self.trainer.accelerator.print(f"done: step {self.trainer.state.step}; the replica group of rank 0 exports the model")

    def close(self) -> None:
        self.group.shutdown()
