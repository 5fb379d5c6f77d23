"""Silent data corruption across replica groups: every group holds the whole training state (each process of a group
its part under FSDP, the same part as process k of every other group), so the groups' copies are compared as the
processes' copies are inside a job (infra.sdc).

When: at every `sdc_check_steps` step and every `save_steps` step (the state the saving group has just written is
checked before the next step commits), in the next try's one sum across the quorum (the item count's, infra.replicas.
combine): each process sends the integer sum of the bits of its weights and optimizer state (infra.sdc.state_bits) in
its group's slot (two float64 halves: exact), so every group gets every group's number in the same sum, and the same
decision comes out everywhere. No other collective, and nothing between a commit and the next quorum.

On a mismatch every group fails that try's commit (the gradients of a wrong copy must not count), and:

- groups that differ from a majority are named; each sets its step back so that the next quorum heals it from a live
  group (torchft sends the state of a group at the quorum's step): the try is done again by every group with sound
  copies, as a fault-free run would do it. A group named a second time leaves the quorum after its next committed step
  (exit code 77, its own stopped.json), as a straggler group does.
- no majority (two groups): nobody can tell which is wrong; every group goes back to the newest checkpoint at or before
  the last step whose copies agreed, and trains the steps since again.

A checkpoint written by the saving group after the last agreement is not known sound: when that group is named (or
nobody can be), it removes those checkpoints before the run goes on.
"""

from __future__ import annotations

import torch

from infra.combine import Loop
from infra.sdc import disagreeing, exact_halves, state_bits, whole


class GroupCopies:
    """This group's side of the comparison: what it sends, what it makes of the sum."""

    def __init__(self, loop: Loop, every: int, save_steps: int, active: bool):
        self.loop, self.every, self.save_steps, self.active = loop, every, save_steps, active
        self.agreed_at = 0  # the last step at which every group's copy agreed (or where this launch started)
        self.counts = {"sdc/group_checks": 0, "sdc/group_mismatches": 0}

    def due(self) -> bool:
        """Whether the coming try's sum carries the groups' numbers: the state of a step at the interval or of a step
        saved by save_steps (the same step, and so the same answer, in every group of the quorum)."""
        step = self.loop.at_step
        saved = self.save_steps > 0 and step % self.save_steps == 0
        return self.active and step > 0 and (step % self.every == 0 or saved)

    def report(self, rank: int, size: int) -> torch.Tensor:
        """This process's number in its group's slot of `size` (two float64 halves, exact in any sum of one)."""
        loop = self.loop
        number = torch.tensor(state_bits(loop.accelerator, loop.model, loop.optimizer), dtype=torch.int64)
        sent = torch.zeros(2 * size, dtype=torch.float64)
        sent[2 * rank : 2 * rank + 2] = exact_halves(number)
        return sent

    def received(self, summed: torch.Tensor) -> list[int]:
        """The quorum ranks of the groups whose copies differ from a majority's (every group when there is none), or [].
        In a group of several processes each process's numbers (of its slice, under FSDP) are summed over the group
        first (one small all-reduce inside it), so that every process of a group decides the same."""
        numbers = whole(summed.reshape(-1, 2).cpu())
        acc = self.loop.accelerator
        if acc.num_processes > 1:
            numbers = numbers.to(acc.device)
            torch.distributed.all_reduce(numbers)  # wraps like the numbers themselves: equal in, equal out
            numbers = numbers.cpu()
        self.counts["sdc/group_checks"] += 1
        ranks, _ = disagreeing(numbers.reshape(-1, 1))
        if not ranks:
            self.agreed_at = self.loop.at_step
            return []
        self.counts["sdc/group_mismatches"] += 1
        return ranks
