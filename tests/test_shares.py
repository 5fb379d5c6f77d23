"""What each process trains on (infra.shares): every split of a step's global batch against the even one, which the
loaders read by. The same samples, each once, in as many micro-batches in every process, and the same gradient."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from infra.data import DataCursor, ResumableLoader
from infra.data.ahead import ReadAhead
from infra.data.steps import GlobalBatches
from infra.health import deeper, slow_at_data
from infra.shares import (
    ALONE,
    Seat,
    SizeSchedule,
    Speeds,
    even,
    even_groups,
    fastest_split,
    group_share,
    process_share,
    rebalanced,
    share,
    sliced,
)


class Shards(torch.utils.data.Dataset):
    """Sample i is i, in shards of the given sizes."""

    def __init__(self, sizes: list[int]):
        self.shard_sizes = sizes

    def __len__(self) -> int:
        return sum(self.shard_sizes)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


@pytest.mark.parametrize(("processes", "micro", "accumulation"), [(1, 4, 1), (2, 4, 2), (3, 2, 3), (4, 1, 2)])
def test_the_even_split_is_what_each_rank_of_a_plain_run_reads(processes, micro, accumulation):
    """A step is `accumulation` micro-steps of the loaders' global batches (one process reading them whole sees its
    samples): each rank's loader reads, micro-step after micro-step, its even share of the step's samples."""
    dataset = Shards([32, 32, 20, 32])
    whole = iter(ResumableLoader(dataset, processes * micro, 7, 0, 1, DataCursor(), shuffle_window=24))
    ranks = [iter(ResumableLoader(dataset, micro, 7, r, processes, DataCursor(), shuffle_window=24)) for r in range(processes)]
    for _ in range(12):  # across epochs
        ids = np.concatenate([next(whole).reshape(-1).numpy() for _ in range(accumulation)])
        for rank, loader in enumerate(ranks):
            read = [next(loader).reshape(-1).tolist() for _ in range(accumulation)]
            assert read == [m.tolist() for m in even(ids, rank, processes, micro)]


def test_the_steps_global_batches_are_those_of_the_plain_loader_across_epochs():
    """Step after step (rolling over epochs), what the groups split is what one process with the global batch as its
    batch reads."""
    dataset, size = Shards([32, 32, 20, 32]), 16
    cursor, batches = DataCursor(), GlobalBatches(dataset, 42, 48, size)
    plain = ResumableLoader(dataset, size, 42, 0, 1, DataCursor(), shuffle_window=48)
    for _, expected in zip(range(30), plain, strict=False):  # 7 steps an epoch and 4 samples left out: 4 epochs and 2 steps
        assert batches.ids(cursor).tolist() == expected.reshape(-1).tolist()
        assert batches.read(batches.ids(cursor)).reshape(-1).tolist() == expected.reshape(-1).tolist()
        batches.advance(cursor)
    assert cursor.state_dict() == plain.cursor.state_dict() == {"epoch": 4, "samples_consumed": 32}


def gradient(parts: list[list[np.ndarray]], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The step's gradient of a linear model as the Trainer makes it: each micro-batch's summed loss over the step's items,
    accumulated in each process, summed over the processes (the all-reduce). Processes with no sample add nothing."""
    weight = torch.linspace(-1, 1, inputs.shape[1], dtype=torch.float64).requires_grad_()
    items = sum(len(m) for p in parts for m in p)
    total = torch.zeros_like(weight)
    for micro_batches in parts:
        weight.grad = None
        for m in micro_batches:
            if len(m):
                (((inputs[m] @ weight - targets[m]) ** 2).sum() / items).backward()
        total += weight.grad if weight.grad is not None else 0
    return total


def test_every_split_trains_on_the_even_splits_samples_once_each_with_its_gradient():
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (
        torch.randn(48, 5, generator=generator, dtype=torch.float64),
        torch.randn(48, generator=generator, dtype=torch.float64),
    )
    ids = np.random.default_rng(3).permutation(48)[:24]  # a step's global batch
    reference = [even(ids, rank, 2, 4) for rank in range(2)]  # 2 processes, micro-batches of 4, 3 accumulation steps
    expected = gradient(reference, inputs, targets)
    splits = {"even over 4": [even(ids, r, 4, 2) for r in range(4)], "even over 1": [even(ids, 0, 1, 8)]}
    splits |= {f"share over {n}, micro {m}": [share(ids, s, n, m) for s in range(n)] for n in (1, 3, 5, 7, 24) for m in (1, 4)}
    splits |= {f"sliced {sizes}": [sliced(ids, r, sizes) for r in range(len(sizes))] for sizes in ([1, 7], [5, 3], [2, 2, 4], [1, 1, 1, 5])}
    for size, training in ((3, 3), (3, 2), (4, 1)):  # replica groups of 2 processes, hot spares past `training`
        splits[f"quorum {size}, {training} training"] = [process_share(ids, g, training, p, 2, 4) for g in range(size) for p in range(2)]
    groups = {}  # replica groups rebalanced (infra.replicas.pace): groups of 2 processes, a size each, hot spares past them
    for sizes, size in (([12, 12], 2), ([20, 4], 2), ([1, 23], 3), ([3, 2, 19], 4), ([24], 2)):
        groups[f"groups {sizes} of {size}"] = [[group_share(ids, sizes, g, p, 2, 4) for p in range(2)] for g in range(size)]
    splits |= {name: [p for group in parts for p in group] for name, parts in groups.items()}
    for name, parts in splits.items():
        read = np.concatenate([m for p in parts for m in p])
        assert np.array_equal(np.sort(read), np.sort(ids)) and len(read) == len(ids), name  # the same samples, each once
        if name not in groups:  # as many micro-batches in every process that trains (groups: inside each group)
            assert len({len(p) for p in parts if p}) == 1, name
        torch.testing.assert_close(gradient(parts, inputs, targets), expected, rtol=1e-12, atol=1e-12, msg=name)
    for name, parts in groups.items():
        assert all(len({len(p) for p in group}) == 1 for group in parts), name
    for total, training, processes in ((24, 2, 2), (16, 3, 2), (7, 3, 1), (5, 2, 4)):
        # the even split's groups' sizes, given as sizes, read the same samples in each group as the even split
        ids_ = np.arange(total)
        sizes = even_groups(total, training, processes)
        for g in range(training):
            theirs = [m for p in range(processes) for m in process_share(ids_, g, training, p, processes, 4)]
            ours = [m for p in range(processes) for m in group_share(ids_, sizes, g, p, processes, 4)]
            assert sorted(np.concatenate(ours).tolist()) == sorted(np.concatenate(theirs).tolist()), (total, training, processes, g)
    wrong = [share(ids[:-1], s, 3, 4) for s in range(3)]  # the check's power: one sample short changes the gradient
    assert not torch.allclose(gradient(wrong, inputs, targets), expected)


@pytest.mark.parametrize("size", [16, 10, 7])
def test_any_quorum_splits_a_step_into_every_sample_once_and_as_many_micro_batches_in_every_slot(size):
    ids = np.arange(100, 100 + size)
    for slots in range(1, size + 1):
        for micro in (1, 2, 4, 16):
            parts = [share(ids, slot, slots, micro) for slot in range(slots)]
            assert np.array_equal(np.concatenate([np.concatenate(p) for p in parts]), ids)  # in order, each once
            assert len({len(p) for p in parts}) == 1  # DDP inside a group syncs on the same (last) micro-batch
            assert all(len(m) <= micro for p in parts for m in p) and all(len(p[-1]) for p in parts)


@pytest.mark.parametrize("limit", [0, 1, 2, 3])
def test_the_training_groups_split_the_step_and_hot_spares_get_nothing_at_every_size_of_quorum(limit):
    """training_replicas=limit: the first `limit` groups of a quorum (every one: 0) split the whole step, each sample
    once, and the others (hot spares) read nothing; a quorum that lost a training group takes a spare in its place."""
    ids, processes = np.arange(200, 224), 2
    for size in range(1, 5):
        seat = Seat(rank=0, size=size, id=0, healed_from=None, seconds=0.0)
        training = seat.training(limit)
        assert training == (min(size, limit) if limit else size)
        parts = {(rank, p): process_share(ids, rank, training, p, processes, 4) for rank in range(size) for p in range(processes)}
        read = [m for (rank, _), micro in sorted(parts.items()) if rank < training for m in micro]
        assert np.array_equal(np.concatenate(read), ids)  # in order, each once
        assert all(parts[rank, p] == [] for rank in range(training, size) for p in range(processes))


@pytest.mark.parametrize("workers", [0, 2])
def test_each_rank_reads_its_size_of_every_global_batch_as_the_schedule_says_across_epochs(workers):
    """Sizes changed from a position on, before the loaders start and while they read (past what they read ahead): each
    rank's batch is its slice of that position's global batch, so the ranks together read the plain loader's samples,
    each once, in order, whatever the sizes."""
    dataset, processes, micro = Shards([32, 32, 20, 32]), 3, 4
    whole = iter(ResumableLoader(dataset, processes * micro, 7, 0, 1, DataCursor(), shuffle_window=24))
    loaders = [
        ResumableLoader(dataset, micro, 7, r, processes, DataCursor(), num_workers=workers, shuffle_window=24) for r in range(processes)
    ]
    for loader in loaders:  # one schedule each, as every process holds its own copy of the same decisions
        loader.schedule.change(3, [2, 4, 6])
        loader.schedule.change(9, [1, 1, 10])
    ranks = [iter(loader) for loader in loaders]
    for position in range(30):  # 9 global batches an epoch: across 3 epochs
        if position == 12:
            for loader in loaders:
                loader.schedule.change(position + loader.read_ahead(), [4, 4, 4])  # the first it may not have sliced
        expected, sizes = next(whole).reshape(-1).tolist(), loaders[0].schedule.at(position)
        read = [next(r).reshape(-1).tolist() for r in ranks]
        assert [len(r) for r in read] == sizes and sum(read, []) == expected, position
    assert loaders[0].schedule.at(29) == [4, 4, 4]


def test_the_mixtures_ranks_read_their_sizes_of_its_global_batches():
    from infra.data.mixture import MixtureCursor, MixtureLoader
    from tests.test_mixture import mixture

    sizes, (sources, dataset, shards) = [40, 90], mixture([40, 90], [0.7, 0.3])

    def loader(rank: int, processes: int, batch: int) -> MixtureLoader:
        return MixtureLoader(dataset, MixtureCursor(sources, sizes), shards, batch, 3, rank, processes, shuffle_window=4)

    whole, loaders = iter(loader(0, 1, 12)), [loader(r, 3, 4) for r in range(3)]
    for each in loaders:
        each.schedule.change(2, [1, 5, 6])
    ranks = [iter(each) for each in loaders[:2]] + [ReadAhead(loaders[2], 5)]  # rank 2 reads ahead in a thread
    for position in range(80):  # past a block of 64 global batches
        read = [next(r).reshape(-1).tolist() for r in ranks]
        assert [len(r) for r in read] == loaders[0].schedule.at(position)
        assert sum(read, []) == next(whole).reshape(-1).tolist(), position
        assert repr(loaders[2].cursor) == repr(loaders[0].cursor), position  # moved as the loop took its batch
    ranks[2].close()


def test_the_fastest_split_finishes_first_in_whole_samples_within_its_bounds():
    def proportional(speeds):
        return lambda p, size: size / speeds[p]

    assert fastest_split(8, proportional([1.0, 1.0]), 2) == [4, 4]
    assert fastest_split(9, proportional([1.0] * 4), 4) == [3, 2, 2, 2]  # ties: the lower rank
    assert fastest_split(8, proportional([1.0, 1 / 3]), 2) == [6, 2]  # a process at a third of the speed
    assert fastest_split(16, proportional([1.0, 1.0, 1.0, 0.01]), 4) == [5, 5, 5, 1]  # the floor: it takes part
    assert fastest_split(16, proportional([1.0, 1.0, 1.0, 0.01]), 4, floor=2) == [5, 5, 4, 2]
    assert fastest_split(16, proportional([10.0, 1.0]), 2, caps=[9, 16]) == [9, 7]  # what fits in its memory
    rng = np.random.default_rng(0)
    for _ in range(200):  # the least slowest time: no sample moved from the slowest process to another does better
        n, floor = int(rng.integers(1, 7)), int(rng.integers(1, 3))
        total = int(rng.integers(n * floor, 120))
        overhead, per_sample = rng.uniform(0, 0.01, n), rng.uniform(0.001, 0.02, n)

        def seconds(p, size, overhead=overhead, per_sample=per_sample):
            return overhead[p] + per_sample[p] * size

        sizes = fastest_split(total, seconds, n, floor)
        assert sum(sizes) == total and min(sizes) >= floor and sizes == fastest_split(total, seconds, n, floor)
        slowest = max(range(n), key=lambda p: seconds(p, sizes[p]))
        for other in range(n):
            if other != slowest and sizes[slowest] > floor:
                moved = sizes.copy()
                moved[slowest] -= 1
                moved[other] += 1
                assert max(seconds(p, moved[p]) for p in range(n)) >= max(seconds(p, sizes[p]) for p in range(n)) - 1e-12
    with pytest.raises(ValueError, match="no split of 3 samples among 4 processes"):
        fastest_split(3, proportional([1.0] * 4), 4)
    with pytest.raises(ValueError, match="do not split a micro-step of 8 among 2"):
        SizeSchedule([4, 4]).change(5, [0, 8])


def test_rebalancing_gives_no_process_more_than_its_memory_holds():
    """Rank 0 ten times faster would take 15 of 16 samples; its memory holds 9 (infra.memory.sample_caps): it gets 9,
    and the probe does not take it past its cap either. Caps that could not hold the micro-step are not applied."""
    speeds = Speeds(2)
    speeds.overhead, speeds.per_sample, speeds.fraction = [0.0, 0.0], [0.001, 0.01], [0.0, 0.0]
    assert rebalanced([8, 8], speeds) == [15, 1]
    assert rebalanced([8, 8], speeds, caps=[9, 64]) == [9, 7]
    assert rebalanced([8, 8], speeds, caps=[7, 7]) == [15, 1]  # 14 < 16: the estimate is wrong, not the micro-step
    speeds.per_sample = [0.01, 0.006]  # the model's best is [6, 10]; the times measured there say rank 0 finished first
    speeds.last = [(6.0, 0.05), (10.0, 0.1)]
    assert rebalanced([6, 10], speeds) == [7, 9]  # the probe: one more for it
    assert rebalanced([6, 10], speeds, caps=[6, 64]) is None  # at its cap: no probe


def test_a_process_given_fewer_samples_does_not_look_slower_for_its_overhead():
    """Two processes alike but for rank 1 three times slower a sample, each micro-batch 6 ms of overhead besides: the
    shares move to the fast one until the times agree, and once both are alike again they come back to even, not stuck
    at the floor (a seconds-a-sample view without the overhead would keep taking samples from the one with fewer)."""

    def measure(sizes, per_sample):
        return [0.006 + t * s for s, t in zip(sizes, per_sample, strict=True)]

    speeds, sizes, seen = Speeds(2), [4, 4], []
    for window in range(12):
        per_sample = [0.001, 0.003] if window < 6 else [0.001, 0.001]
        speeds.measured(sizes, measure(sizes, per_sample))
        sizes = rebalanced(sizes, speeds) or sizes
        seen.append(sizes)
    # 6 samples at 1 ms and 2 at 3 ms both take 12 ms: there within two windows, and held there
    assert seen[1:6] == [[6, 2]] * 5 and seen[0][1] < 4, seen
    # alike again: back to even within a sample (rank 0's overhead is not known: its sizes never moved by a quarter;
    # so 4 and 4 look 4.5% faster than 5 and 3, short of the 5% a move must gain)
    assert seen[-3:] in ([[4, 4]] * 3, [[5, 3]] * 3) and seen[7:] == [seen[-1]] * 5, seen
    assert speeds.fraction == [0.0, Speeds.MOST_OVERHEAD]  # rank 1's 6 ms of 9: counted as half, never more
    assert rebalanced([4, 4], speeds) is None  # nothing to gain: nothing moves
    assert rebalanced([4, 4], Speeds(2)) is None  # not measured yet


@pytest.mark.parametrize("processes", [2, 4])
def test_shares_settle_and_hold_under_noisy_times(processes):
    """A host at half speed (its overhead and its samples alike: 3 samples' worth of overhead a micro-batch). Measured
    exactly, the shares reach the split that evens the true times (or one within the 5% a move must gain) within two
    windows and stay. With every window's
    times off by up to 15% at random (a CPU quota's time comes in bursts), the steps keep within 10% of that split's
    time on average and 25% at worst, and the slow host never gets more than a fast one (a per-process overhead from
    two windows a sample apart made the split swing, the slow host taking more than the fast for a window)."""
    rng = np.random.default_rng(1)
    pace = [0.002] * processes
    pace[1] = 0.004

    def true(p, size):
        return pace[p] * (3 + size)

    def step_time(sizes):
        return max(true(p, size) for p, size in enumerate(sizes))

    total = 8 * processes
    best = fastest_split(total, true, processes)
    for noise in (0.0, 0.15):
        for _ in range(20 if noise else 1):
            speeds, sizes, seen = Speeds(processes), [8] * processes, []
            for _window in range(30):
                speeds.measured(sizes, [true(p, size) * rng.uniform(1 - noise, 1 + noise) for p, size in enumerate(sizes)])
                sizes = rebalanced(sizes, speeds) or sizes
                seen.append(sizes)
            assert all(split[1] <= min(split[p] for p in range(processes) if p != 1) for split in seen), seen
            if not noise:  # settled by the second window: the best split, or one a move to it gains under 5% of
                assert seen[2:] == [seen[1]] * 28 and step_time(best) / step_time(seen[1]) >= 0.92, (best, seen)
            efficiency = [step_time(best) / step_time(split) for split in seen[2:]]
            assert np.mean(efficiency) >= 0.9 and min(efficiency) >= 0.75, (noise, best, seen)


def test_a_process_rebalancing_cannot_keep_up_with_is_named_once_it_has_been_for_long_enough():
    from infra.shares import KeepingUp

    speeds = Speeds(3)
    speeds.per_sample = [0.001, 0.0011, 0.005]  # rank 2 5x the median's a sample
    keeping = KeepingUp(3, factor=4.0, patience=2, floor=1)
    assert keeping.behind(speeds, [4, 4, 4], slow=[]) == {}  # once: not yet
    assert keeping.behind(speeds, [4, 4, 4], slow=[]) == {2: "4.5x the median process's seconds a sample for 2 windows"}
    speeds.per_sample[2] = 0.002  # better: the streak starts again
    assert keeping.behind(speeds, [5, 6, 1], slow=[]) == {} and keeping.streak == [0, 0, 0]
    # reported slow by its step through a window at its floor: nothing left to give it
    assert keeping.behind(speeds, [5, 6, 1], slow=[2]) == {2: "still the slowest step at the floor of its share (1 sample)"}
    assert keeping.behind(speeds, [5, 5, 2], slow=[2]) == {}  # not at the floor: rebalancing goes on
    # at the floor its seconds a sample are a guess: 5x the median's, but its step not the slowest, counts for nothing
    speeds.per_sample[2] = 0.005
    assert [keeping.behind(speeds, [7, 8, 1], slow=[]) for _ in range(3)] == [{}, {}, {}] and keeping.streak == [0, 0, 0]
    off = KeepingUp(3, factor=0.0, patience=1, floor=1)  # off: never, neither by speed nor at the floor
    speeds.per_sample = [0.001, 0.001, 1.0]
    assert off.behind(speeds, [7, 4, 1], slow=[2]) == {}


def test_a_resize_waits_for_what_the_loaders_read_ahead_and_a_checkpoint_keeps_it():
    from infra.data.steps import EvenShares

    dataset = Shards([32, 32, 20, 32])
    loaders = [ResumableLoader(dataset, 4, 7, r, 2, DataCursor(), num_workers=1, shuffle_window=24) for r in range(2)]
    shares = [EvenShares(loader, 2) for loader in loaders]  # 2 micro-batches a step
    for each in shares:
        each.start()
    for _ in range(3):  # 3 steps read: position 6
        [each.take(ALONE, 0, None) for each in shares]
    # read ahead 3 (one worker): position 9; the next step that starts after it at 10: two steps before it
    assert [each.resize([3, 5]) for each in shares] == [2, 2]
    assert shares[0].sizes() == [4, 4] and shares[0].sizes(ahead=True) == [3, 5]
    taken = [[[len(m.ids) for m in each.take(ALONE, 0, None)] for each in shares] for _ in range(3)]
    assert taken == [[[4, 4], [4, 4]], [[4, 4], [4, 4]], [[3, 3], [5, 5]]]
    saved = shares[0].state_dict()
    assert saved == {"schedule": {"even": [4, 4], "changes": [[10, [3, 5]]]}, "read_ahead": [0, 0]}

    fresh = EvenShares(ResumableLoader(dataset, 4, 7, 0, 2, DataCursor()), 2)
    assert fresh.load_state_dict(saved) is None and fresh.loader.schedule.at(10) == [3, 5]
    other = EvenShares(ResumableLoader(dataset, 8, 7, 0, 1, DataCursor()), 2)  # another world size: even again
    assert other.load_state_dict(saved) == "shares: the checkpoint's were of 2 processes x 4; even shares from here"
    assert other.loader.schedule.at(10) == [8]


def test_a_recorded_schedule_is_replayed_from_the_first_step_where_it_splits_this_runs_micro_steps(tmp_path):
    """straggler_replay: a run's checkpoint (or its output_dir: the newest) gives its shares from the start; one of
    another split is refused in a phrase, and so is a path that holds no checkpoint."""
    from infra.checkpoint import CheckpointError, manifest_of
    from infra.data.steps import EvenShares

    recorded = {"schedule": {"even": [4, 4], "changes": [[2, [3, 5]], [6, [1, 7]]]}}
    for step, changes in ((4, recorded["schedule"]["changes"][:1]), (8, recorded["schedule"]["changes"])):
        folder = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"step": step, "shares": {"schedule": {"even": [4, 4], "changes": changes}}}))
    assert manifest_of(tmp_path / "run", "shares")["step"] == 8  # the newest
    assert manifest_of(tmp_path / "run" / "checkpoints" / "step_00000004", "shares")["step"] == 4

    dataset = Shards([32, 32, 20, 32])
    shares = [EvenShares(ResumableLoader(dataset, 4, 7, r, 2, DataCursor(), shuffle_window=24), 1) for r in range(2)]
    assert all(each.replay(recorded) is None for each in shares)
    for each in shares:
        each.start()
    taken = [[len(each.take(ALONE, 0, None)[0].ids) for each in shares] for _ in range(8)]
    assert taken == [[4, 4], [4, 4], [3, 5], [3, 5], [3, 5], [3, 5], [1, 7], [1, 7]]
    other = EvenShares(ResumableLoader(dataset, 4, 7, 0, 3, DataCursor()), 1)
    assert other.replay(recorded) == "its shares split micro-steps of 2 processes x 4, this run's are 3 x 4"

    with pytest.raises(CheckpointError, match="is not a checkpoint: expected a checkpoint folder"):
        manifest_of(tmp_path, "shares")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({"step": 2}))
    with pytest.raises(CheckpointError, match="records no shares"):
        manifest_of(tmp_path / "old", "shares")


class Flaky(Shards):
    """Shards whose sample `bad` cannot be read."""

    def __init__(self, sizes: list[int], bad: int):
        super().__init__(sizes)
        self.bad = bad

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise OSError(f"sample {i}: input/output error")
        return super().__getitem__(i)


def settled(read: list[int], count: int) -> bool:
    """Whether the reads reached `count` within 10 s (a thread's), and stayed there a moment."""
    deadline = time.monotonic() + 10
    while len(read) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.1)
    return len(read) == count


@pytest.mark.parametrize("workers", [0, 2])
def test_a_thread_reading_ahead_hands_out_the_loaders_batches_and_the_cursor_moves_as_the_loop_takes_them(workers):
    """ReadAhead (infra.data.ahead): the same batches, ids and cursor after each as the loader's own iterator, across
    epochs and a change of the shares placed past what it read ahead; it reads `depth` ready and one in hand ahead of
    the loop, no further; closed, its thread ends; a read that fails raises in the loop, after the batches before it."""
    dataset, processes, micro = Shards([32, 32, 20, 32]), 2, 4
    rank_1 = lambda data: ResumableLoader(data, micro, 7, 1, processes, DataCursor(), num_workers=workers, shuffle_window=24)  # noqa: E731
    plain, ahead = rank_1(dataset), rank_1(dataset)
    read: list[int] = []
    ahead.on_read = read.append
    batches, depth = ReadAhead(ahead, 3), 3
    assert settled(read, depth + 1)  # nothing taken: `depth` ready and one in hand
    expected = iter(plain)
    for position in range(40):  # 14 global batches an epoch: across 3 epochs
        if position == 12:
            for loader in (plain, ahead):
                loader.schedule.change(position + loader.read_ahead(depth), [2, 6])
        assert next(batches).tolist() == next(expected).tolist(), position
        assert ahead.last_sample_ids == plain.last_sample_ids and repr(ahead.cursor) == repr(plain.cursor), position
    assert settled(read, 40 + depth + 1) and ahead.read_ahead(depth) == 2 * workers + 1 + depth + 1
    assert len(ahead.last_sample_ids) == 6  # the change, in force
    batches.close()
    expected.close()
    assert not batches._thread.is_alive() and repr(ahead.cursor) == repr(plain.cursor)  # what it read past: never counted

    flaky = rank_1(Flaky([32, 32], bad=global_order_of(plain.seed, 5)[1]))
    failing = ReadAhead(flaky, 2)
    taken = [next(failing) for _ in range(5)]  # the five global batches before the bad sample's
    with pytest.raises(OSError, match="input/output error"):
        next(failing)
    assert len(taken) == 5 and flaky.cursor.samples_consumed == 5 * micro * processes
    failing.close()


def test_closing_a_read_ahead_stuck_in_a_read_leaves_the_thread_behind(monkeypatch):
    """A storage that stopped answering: close() gives the thread CLOSE_WAIT seconds, then returns (the loop's exit is
    never held up); the thread, a daemon, ends once its read does, and reads nothing more."""
    answered = threading.Event()

    class Stuck(Shards):
        def __getitem__(self, i: int) -> torch.Tensor:
            answered.wait(timeout=30)
            return super().__getitem__(i)

    monkeypatch.setattr(ReadAhead, "CLOSE_WAIT", 0.2)
    read: list[int] = []
    loader = ResumableLoader(Stuck([32, 32]), 4, 7, 0, 2, DataCursor())
    loader.on_read = read.append
    batches = ReadAhead(loader, 2)
    began = time.monotonic()
    batches.close()
    assert time.monotonic() - began < 5 and batches._thread.is_alive() and read == []
    answered.set()
    batches._thread.join(timeout=10)
    assert not batches._thread.is_alive() and read == [4]  # the read in its hands, then nothing more
    assert loader.cursor.samples_consumed == 0


def global_order_of(seed: int, position: int) -> list[int]:
    """The global ids of rank 1's slice (of 2, of 4 samples) of global batch `position` of the first epoch of [32, 32]
    samples, in windows of 24."""
    from infra.data.loader import EpochOrder

    return EpochOrder([32, 32], seed, 0, 24)[position * 8 : (position + 1) * 8][4:8].tolist()


def test_read_further_starts_a_thread_where_the_loop_is_and_a_resize_counts_its_depth():
    """EvenShares.read_further mid-run: the steps' samples are those of shares that never read ahead; the next change of
    the shares is placed past the deepest read-ahead of any process (the same position on every process); a checkpoint
    keeps the depths and a resumed reader reads ahead as before; close() stops the thread."""
    from infra.data.steps import EvenShares

    dataset = Shards([32, 32, 20, 32])
    make = lambda r: EvenShares(ResumableLoader(dataset, 4, 7, r, 2, DataCursor(), shuffle_window=24), 2)  # noqa: E731
    shares, plain = [make(r) for r in range(2)], [make(r) for r in range(2)]
    for each in shares + plain:
        each.start()
    ids = lambda group: [[m.ids for m in each.take(ALONE, 0, None)] for each in group]  # noqa: E731
    assert str(ids(shares)) == str(ids(plain))
    for each in shares:
        each.read_further([0, 4])  # rank 1 waits for its data
    assert not isinstance(shares[0].batches, ReadAhead) and shares[1].batches.depth == 4
    # at position 2 (one step): past one batch read ahead without a thread, and rank 1's 4 ready and 1 in hand: 8
    assert [each.resize([3, 5]) for each in shares] == [3, 3] and shares[1].loader.schedule.changes == [(8, [3, 5])]
    for each in plain:
        each.loader.schedule.change(8, [3, 5])
    for _ in range(6):
        assert str(ids(shares)) == str(ids(plain))
    saved = shares[1].state_dict()
    assert saved["read_ahead"] == [0, 4]
    with pytest.raises(AssertionError):
        shares[1].read_further([0, 2])  # never lowered: a resize counts the deepest
    resumed = make(1)
    assert resumed.load_state_dict(saved) is None and resumed.depths == [0, 4]
    resumed.loader.cursor.load_state_dict(shares[1].loader.cursor.state_dict())
    resumed.start()
    assert isinstance(resumed.batches, ReadAhead) and str(ids([resumed])) == str(ids([plain[1]]))
    threads = [each.batches._thread for each in (shares[1], resumed)]
    for each in shares + plain + [resumed]:
        each.close()
    assert not any(thread.is_alive() for thread in threads)


def test_a_process_slow_at_its_data_reads_two_steps_ahead_and_never_less():
    """deeper: a wait for data past the median process's, over 5% of a micro-batch's time and over its compute past the
    median's -> two steps' micro-batches read ahead; the same numbers give the same depths on every process; a process
    slow at everything (a throttled CPU), or whose reads are merely a part of a small step as everyone's, does not;
    never lowered; None when nothing changes."""
    assert deeper([0, 0, 0], waits=[0.001, 0.02, 0.001], seconds=[0.1, 0.12, 0.1], accumulation=3) == [0, 6, 0]
    assert deeper([0, 6, 0], waits=[0.001, 0.0, 0.0], seconds=[0.1, 0.1, 0.1], accumulation=3) is None  # kept
    assert deeper([0, 0], waits=[0.01, 0.01], seconds=[0.1, 0.1], accumulation=1) is None  # everyone's 10%: a small step
    assert deeper([0, 0], waits=[0.001, 0.01], seconds=[0.1, 0.4], accumulation=1) is None  # slow at everything
    assert deeper([0, 0], waits=[0.001, 0.005], seconds=[0.1, 0.104], accumulation=1) is None  # 4% past the median's
    assert deeper([0, 0], waits=[0.001, 0.3], seconds=[0.1, 0.4], accumulation=2) == [0, 4]  # a slow disk
    # one rule with the straggler line's cause ("data loading" where slow_at_data): the line names a slow read below 5%
    assert slow_at_data([0.001, 0.005], [0.1, 0.104]) == [False, True]
    assert slow_at_data([0.001, 0.01], [0.1, 0.4]) == [False, False]  # "compute"
    assert slow_at_data([0.001, 0.3], [0.1, 0.4], least=0.05) == [False, True]
