"""The watchdog's rules in one process: the step deadline, who is named for which error, a store that never answers."""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest

from infra.hangs import (
    AUTO_FLOOR_SECONDS,
    SILENT_FLOOR_SECONDS,
    STORE_WAIT,
    Peer,
    Watchdog,
    silence_deadline,
    step_deadline,
)

PEERS = [Peer(0, "h0", ("10.0.0.1",)), Peer(1, "h1", ("10.0.0.2", "192.168.5.2")), Peer(2, "h1", ("10.0.0.2", "192.168.5.2"))]


class Store:
    """The launcher's store as the watchdog uses it: set, get, set_timeout; `hang` makes every get wait forever."""

    def __init__(self, values: dict[str, str], hang: bool = False):
        self.values, self.hang = values, hang

    requests = 0  # multi_get calls

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.requests += 1
        return [self.get(key) for key in keys]

    def check(self, keys: list[str]) -> bool:
        if self.hang:
            threading.Event().wait()
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        if key not in self.values:
            threading.Event().wait()  # the real store waits for the key (its timeout is the process group's)
        return self.values[key].encode()


def watchdog(tmp_path, store=None, rank: int = 0) -> Watchdog:
    one = SimpleNamespace(num_processes=1, process_index=rank)  # no thread, no store of its own: the rules alone
    dog = Watchdog(one, str(tmp_path), start_timeout=1800, step_timeout=0, peers=PEERS)
    dog.store, dog.step, dog.started = store, 7, True
    return dog


def test_the_step_deadline_follows_the_slowest_recent_step_with_a_floor():
    assert step_deadline(0, deque()) == AUTO_FLOOR_SECONDS
    assert step_deadline(0, deque([0.3] * 50)) == AUTO_FLOOR_SECONDS
    assert step_deadline(0, deque([2.0, 12.0, 3.0])) == 60.0
    assert step_deadline(45, deque([100.0])) == 45  # set by hand: as set


def test_a_silent_peer_ends_a_late_step_before_the_step_deadline_and_a_slow_step_does_not(tmp_path):
    """Past the silence deadline (max(8 s, 5 x the slowest step)) a stale stamp or a store out of reach is a fault;
    a peer alive and merely slow is waited for until the step deadline. The store is asked at most every 2 s."""
    assert silence_deadline(0, deque([0.3] * 50)) == SILENT_FLOOR_SECONDS
    assert silence_deadline(0, deque([2.0, 12.0, 3.0])) == 60.0  # as the step deadline: the factor decides both
    assert silence_deadline(5, deque([0.3])) == 5  # a step deadline set by hand below it
    now = time.time()
    steps = {f"infra/step/{r}": "7" for r in range(3)}
    alive = {f"infra/alive/{r}": f"{now}" for r in range(3)}
    dog = watchdog(tmp_path, Store({**steps, **alive, "infra/alive/1": f"{now - 12}"}))
    dog.recent.extend([0.3] * 10)
    assert dog.check(7) is None
    finding = dog.check(9)
    assert finding.fault == "no answer" and list(finding.lost) == [{"rank": 1, "host": "h1"}]
    assert "no step finished for 9s (deadline 8s); no answer from rank 1 on h1 for 12s" in finding.message
    assert dog.check(10) is None  # asked a moment ago
    slow = watchdog(tmp_path, Store({**steps, **alive}))
    assert slow.check(11) is None
    slow._asked -= 2.0
    assert slow.check(29) is None  # asked again: every peer answers
    assert slow.check(31).fault == "hung step"
    with dog.relaxed():  # a save: a peer writing may starve its stamp thread; only the start-up timeout counts
        assert dog.check(100) is None
    cut_off = watchdog(tmp_path, Store({}, hang=True), rank=1)
    assert cut_off.check(11).message.endswith("or the link between the hosts is down")


def test_saves_loads_and_evaluations_get_the_start_up_timeout(tmp_path):
    dog = watchdog(tmp_path)
    assert dog.deadline() == AUTO_FLOOR_SECONDS
    with dog.relaxed():
        assert dog.deadline() == 1800
    assert dog.deadline() == AUTO_FLOOR_SECONDS
    dog.started = False  # the first step of a launch: compilation, warm caches
    assert dog.deadline() == 1800


@pytest.mark.parametrize(
    "error",
    [
        "[../gloo/transport/tcp/pair.cc:537] Read error [192.168.5.2]:10392: Connection reset by peer. This is typically caused",
        "[../gloo/transport/tcp/pair.cc:589] Connection closed by peer [10.0.0.2]:41235",
    ],
)
def test_a_reset_connection_names_every_rank_of_the_host_at_that_address(tmp_path, error):
    finding = watchdog(tmp_path).from_error(error)
    assert finding.fault == "connection reset" and list(finding.lost) == [{"rank": 1, "host": "h1"}, {"rank": 2, "host": "h1"}]
    assert finding.message.startswith("peer lost (connection reset): rank 0 on h0, after step 7: rank 1 on h1, rank 2 on h1 (")
    assert finding.message.endswith("closed its connection: its process died or its host is gone")


def test_the_store_tells_a_silent_rank_from_a_stuck_one(tmp_path):
    now = time.time()
    steps = {f"infra/step/{r}": "7" for r in range(3)}
    silent = Store({**steps, "infra/alive/0": f"{now}", "infra/alive/1": f"{now - 40}", "infra/alive/2": f"{now}"})
    finding = watchdog(tmp_path, silent).silent(35, 30)
    assert finding.fault == "no answer" and list(finding.lost) == [{"rank": 1, "host": "h1"}]
    assert "no step finished for 35s (deadline 30s); no answer from rank 1 on h1 for 40s" in finding.message

    stuck = Store({**steps, "infra/step/2": "6", **{f"infra/alive/{r}": f"{now}" for r in range(3)}})
    finding = watchdog(tmp_path, stuck).silent(35, 30)
    assert finding.fault == "hung step" and list(finding.lost) == [{"rank": 2, "host": "h1"}]
    assert "rank 2 on h1 at step 6 while the others finished step 7: alive but stuck in its step" in finding.message


def test_the_store_is_read_in_one_request_when_every_key_is_there(tmp_path):
    now = time.time()
    full = Store({**{f"infra/step/{r}": "7" for r in range(3)}, **{f"infra/alive/{r}": f"{now}" for r in range(3)}})
    steps, stamps, _ = watchdog(tmp_path, full)._read_store()
    assert full.requests == 1 and steps == {0: 7, 1: 7, 2: 7} and set(stamps) == {0, 1, 2}
    partial = Store({"infra/step/0": "7", "infra/alive/0": f"{now}", "infra/alive/2": f"{now}"})
    steps, stamps, _ = watchdog(tmp_path, partial)._read_store()  # key by key, never waiting on a missing one
    assert partial.requests == 0 and steps == {0: 7} and set(stamps) == {0, 2}


def test_a_store_that_never_answers_is_reported_in_seconds(tmp_path):
    start = time.monotonic()
    finding = watchdog(tmp_path, Store({}, hang=True), rank=1).silent(31, 30)
    assert time.monotonic() - start < STORE_WAIT + 1
    assert list(finding.lost) == [{"rank": 0, "host": "h0"}]
    assert "the job's store on h0 (rank 0's host) does not answer from h1" in finding.message


def test_forensics_hold_the_line_the_last_collective_and_every_threads_stack(tmp_path):
    dog = watchdog(tmp_path)
    dog.entering("the step agreement's all-reduce")
    path = dog.write_forensics("peer lost (no answer): ...")
    text = path.read_text()
    assert path.name == "step00000007_rank0_h0.txt"
    assert "last collective entered: the step agreement's all-reduce (step 8)" in text and "--- thread MainThread" in text
    assert "test_forensics_hold_the_line" in text  # this thread's own frame


def test_only_a_collectives_error_is_taken_for_a_lost_peer(tmp_path, monkeypatch):
    dog = watchdog(tmp_path, Store({}))
    fired = []
    monkeypatch.setattr(dog, "fire", lambda finding, join: fired.append(finding))
    with pytest.raises(TimeoutError), dog.explaining():  # a read from object storage that timed out: the data's own error
        raise TimeoutError("read timed out")
    with pytest.raises(ValueError), dog.explaining():
        raise ValueError("no such column")
    with dog.explaining():
        raise RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.2]:41235")
    assert [list(f.lost) for f in fired] == [[{"rank": 1, "host": "h1"}, {"rank": 2, "host": "h1"}]]


def test_a_reset_without_an_address_names_no_one(tmp_path):
    finding = watchdog(tmp_path).from_error("Broken pipe")
    assert list(finding.lost) == [] and "a peer closed its connection" in finding.message


def test_the_line_a_watchdog_exits_with_starts_a_line_of_its_own_below_a_progress_bar():
    """The bar ends its line only when drawn again: the peer-lost line of a dead link was glued to `train: 17%|...]`."""
    import io

    from tqdm.auto import tqdm

    from infra.hangs import own_line

    assert own_line("peer lost (no answer): x") == "peer lost (no answer): x"
    bar = tqdm(total=4, file=io.StringIO())
    bar.update(1)
    assert own_line("peer lost (no answer): x") == "\npeer lost (no answer): x"
    bar.close()
    assert own_line("peer lost (no answer): x") == "peer lost (no answer): x"
    with tqdm(total=4, file=io.StringIO(), disable=True):  # another rank's: no bar drawn
        assert own_line("y") == "y"
