"""How a replica group's step is combined with the other groups' (fault_tolerance=replicas): the quorum before every
try at a step, the gradients summed across the live groups, the update only on commit, a heal from a peer. The loop's
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

import torch

from infra.combine import Loop
from infra.hangs import SILENT_AFTER
from infra.health import DesyncError
from infra.replicas.copies import GroupCopies
from infra.replicas.pace import Decision, GroupPace
from infra.replicas.quorum import ReplicaGroup, as_parts, digest, from_part
from infra.shares import Seat, rebalanced_line
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

    def bind(self, loop: Loop) -> None:
        self.loop, self.args = loop, loop.args
        self.group = ReplicaGroup(loop.accelerator, loop.args, self.replica_state, self.load_replica_state)
        # Inside a step a rank may wait on the other groups for up to replica_timeout_seconds (a sum, the commit), and
        # torchft can keep its stamp thread from running meanwhile: the group's own watchdog allows for that before it
        # takes a silent rank of the group for lost. The other groups leave this one out after that timeout anyway.
        loop.watch.allow_waits(2 * loop.args.replica_timeout_seconds + SILENT_AFTER)
        if loop.args.straggler_action == "rebalance":
            self.pace = GroupPace(loop.args, loop.accelerator.num_processes)
        args = loop.args
        self.copies = GroupCopies(loop, args.sdc_check_steps, args.save_steps, args.sdc_action != "off")

    @property
    def saves(self) -> bool:
        """By the group of rank 0 in the quorum only: every group holds the same state (not by one that leaves it: the
        others go on, and the next rank 0 saves)."""
        return self.seat_rank == 0 and self.leaving is None

    # -- the state a group heals from ------------------------------------------------------------------------------

    def replica_state(self) -> dict:
        """Everything a healing group needs to train on as this one (called by torchft between two steps); under FSDP
        this process's parts of the sharded weights and moments."""
        return as_parts(self.loop.live_state())

    def load_replica_state(self, state: dict) -> None:
        self.loop.load_live_state(state, from_part)

    # -- the loop's calls (infra.combine) -----------------------------------------------------------------------

    def restore(self, load) -> tuple[str | None, dict]:
        """The first quorum; a heal from a live group, or (every group fresh) the newest checkpoint."""
        self.seat = self.join_quorum()
        if self.seat.healed_from is not None:
            self.copies.agreed_at = self.loop.at_step  # a live group's state
            return f"a live replica group ({self.seat.seconds:.1f}s)", {"metrics": self.loop.latest}
        path, manifest = load()
        self.copies.agreed_at = self.loop.at_step  # every group of the quorum starts from this checkpoint
        self.group.set_step(self.loop.at_step)
        # this group's own MLflow run and goodput ledger, not those of the group that saved
        return path, {k: v for k, v in manifest.items() if k not in ("mlflow_run_id", "goodput")}

    def join_quorum(self) -> Seat:
        """The quorum of the next step; a group behind the others gets their state here."""
        seat = self.group.quorum()
        if seat.healed_from is not None:
            self.heals.append((seat.healed_from, seat.seconds))
            self.loop.healed()
        return seat

    def who(self) -> str:
        acc, seat = self.loop.accelerator, self.seat
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
            with self.loop.watch.relaxed("the quorum"):  # bounded by quorum_timeout_seconds
                self.seat = self.join_quorum()
        seat, self.seat = self.seat, None
        self.seat_rank, self.size = seat.rank, seat.size
        return seat if self.pace is None else self.pace.seat(seat)

    def count(self, items: torch.Tensor) -> torch.Tensor:
        """This group's items, summed over the quorum's groups."""
        self.costs["ft/samples"] = self.loop.samples_read  # this process's share (a hot spare: none)
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
        self.loop.watch.log(dict(self.copies.counts), step=self.loop.at_step)
        if self.found:
            who = ", ".join(f"group {g}{' (this one)' if g == self.seat_rank else ''}" for g in self.found)
            line = f"sdc: the replica groups' copies of the state disagree at step {self.loop.at_step}: {who} apart"
            self.say(line + ("" if len(self.found) < self.size else " (no majority: which is wrong cannot be told)"))
            self.group.fail(line)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """The gradients of a group of several processes synced on the last micro-batch only, as accelerate does;
        `gradient_accumulation_steps` is 1 (infra.accelerator), so the loss is not divided."""
        acc = self.loop.accelerator
        return acc.no_sync(self.loop.model) if acc.num_processes > 1 and not last else contextlib.nullcontext()

    def gradients(self, step_loss: torch.Tensor, num_items_in_batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients and this rank's summed item losses, summed over the groups (one all-reduce)."""
        if self.pace is not None:
            self.measure()
        self.loop.watch.entering("the gradient all-reduce (across replica groups)")
        summing = time.perf_counter()
        loss_sum = self.group.sum_gradients(self.loop.model, step_loss * num_items_in_batch)
        self.costs["ft/gradient_sum_seconds"] = time.perf_counter() - summing
        return loss_sum / num_items_in_batch, loss_sum

    def measure(self) -> None:
        """This group's time of the try: the read and the passes, not the count's wait on the other groups; its slowest
        process's (one all-reduce inside the group), so that every process sends the same."""
        loop = self.loop
        began, ended = self.counted
        seconds = torch.tensor([(began - loop.step_started) + (time.perf_counter() - ended)], device=loop.accelerator.device)
        if loop.accelerator.num_processes > 1:
            torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
        self.pace.measured(float(seconds))

    def commit(self) -> bool:
        self.loop.watch.entering("the commit")
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
                live = f"{seat.size} group{'s' if seat.size > 1 else ''} live (were {self.live}) from step {self.loop.at_step}"
                self.say(live + (f", {spares} of them hot spare{'s' if spares != 1 else ''}" if self.args.training_replicas else ""))
            self.live, self.quorum_id = seat.size, seat.id
        for step, seconds in self.heals:
            self.group.tell(f"healed from a live group to step {step} in {seconds:.1f}s (xxh3 {self.group.loaded_digest})")
            metrics |= {"ft/heal_seconds": seconds}
        self.heals.clear()
        if self.pace is not None and (decision := self.pace.committed(self.loop.at_step)) is not None:
            metrics |= self.paced(seat, decision)
        self.loop.watch.log(metrics, step=self.loop.at_step)

    def paced(self, seat: Seat, decision: Decision) -> dict[str, float]:
        """A window's decision said: a line when the shares change or a group is left out; this group's stop when it is
        the one; each training group's share and step time over the median's (shares/group_i, straggler/group_i: by rank
        in the quorum)."""
        step = self.loop.at_step

        def name(g: int) -> str:
            return f"group {g}{' (this one)' if g == seat.rank else ''}"

        if decision.after != decision.before and step < self.args.max_steps:
            what, names = f"the step's {sum(decision.after)} samples among the training groups", map(name, range(len(decision.after)))
            self.say(rebalanced_line(what, list(names), decision.before, decision.after, decision.per_sample, step + 1))
        left = len(decision.behind)
        for g, why in decision.behind.items():
            if seat.size - left < self.args.min_replicas:
                least = f"min_replicas={self.args.min_replicas}"
                self.say(f"straggler: {name(g)} cannot be kept up with ({why}); it stays: fewer than {least} groups would be left")
            elif g == seat.rank:
                self.say(f"straggler: this group cannot be kept up with ({why}); it leaves the quorum, which goes on without it")
                hosts = sorted(set(self.loop.hosts))
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
        step = self.loop.at_step + 1
        self.say(f"step {step} did not commit ({self.group.why_not()}): done again on the same samples")
        self.loop.watch.log({"ft/steps_redone": self.redone}, step=step, again=True)

    def mend(self) -> None:
        """After copies found apart (infra.replicas.copies): the saving group sets aside its checkpoints since the last
        agreement when it may be the wrong one; a group apart from a majority heals from a live group at the next
        quorum (named a second time, it leaves after the next committed step); with no majority every group goes
        back to the newest checkpoint from before."""
        loop, named, self.found = self.loop, self.found, []
        majority, step, agreed = len(named) < self.size, loop.at_step, self.copies.agreed_at
        suspect = self.seat_rank == 0 and (self.seat_rank in named or not majority)  # the saver may have written them wrong
        if suspect and (moved := loop.checkpoints.set_aside(agreed)):
            self.say(f"sdc: set aside {', '.join(moved)} (written after the copies last agreed, at step {agreed})")
        if not majority:
            path = loop.checkpoints.newest_through(agreed)
            if path is None:
                raise DesyncError(f"the replica groups' copies disagree at step {step} and no checkpoint of step {agreed} or before")
            path = loop.go_back(str(path))  # the groups' step set back with it (rolled_back)
            self.say(f"sdc: back to {Path(path).name}; the {step - loop.at_step} steps since are trained again")
        elif self.seat_rank in named:
            self.times_named += 1
            if self.times_named > 1 and self.leaving is None:
                self.say("sdc: this group's copy was apart a second time: it leaves the quorum after its next step")
                hosts = sorted(set(loop.hosts))
                ranks = list(range(loop.accelerator.num_processes))
                self.leaving = Stop(Reason.SDC, hosts=tuple(hosts), replica_group=self.args.replica_group_id, ranks=tuple(ranks))
            self.say("sdc: this group heals from a live group at the next quorum")
            self.group.set_step(step - 1)  # behind the others: the quorum sends it their state

    def say(self, line: str) -> None:
        self.loop.watch.say(f"replica group {self.args.replica_group_id}: {line}")

    def rolled_back(self) -> None:
        self.group.set_step(self.loop.at_step)

    def export(self, export) -> None:
        """The state every live group ends with (equal everywhere, bit for bit), and the model, by the group of rank 0."""
        self.group.tell(f"final state of step {self.loop.at_step} (xxh3 {digest(self.replica_state())})")
        if self.seat_rank == 0:
            export()
        else:
            self.loop.accelerator.print(f"done: step {self.loop.at_step}; the replica group of rank 0 exports the model")

    def close(self) -> None:
        self.group.shutdown()
