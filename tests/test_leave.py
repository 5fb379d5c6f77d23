"""Hosts left out of a running job (infra.leave): when the job can go on without them in the launch, and how the ranks
of a leaving host end their launcher (and its agent) before they exit. The whole path over two hosts, with a real slow
host, is tests/test_network.py's; these are its parts, quick."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from infra.hangs import LAUNCH_STATUS_ENV, Peer
from infra.leave import MIN_MACHINES_ENV, RENDEZVOUS_HOST_ENV, Standing, end_launcher, in_job_problem, standing

PEERS = [Peer(0, "h0", ("10.0.0.10",)), Peer(1, "h0", ("10.0.0.10",)), Peer(2, "h1", ("10.0.0.11",)), Peer(3, "h2", ("10.0.0.12",))]


@pytest.fixture
def elastic(monkeypatch, tmp_path):
    """A launch by infra.launch for 2 to 3 machines, node 0 at 10.0.0.10."""
    for name, value in {
        MIN_MACHINES_ENV: "2",
        RENDEZVOUS_HOST_ENV: "10.0.0.10",
        LAUNCH_STATUS_ENV: str(tmp_path),
        "GROUP_WORLD_SIZE": "3",
    }.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


@pytest.mark.parametrize(
    ("leaving", "restarts", "replicas", "unset", "expected"),
    [
        (["h1"], [1, 1, 0, 1], False, None, None),  # the leaving host's own agent needs no restart
        (["h2"], [3, 3, 2, 0], False, None, None),
        (["h1"], [1, 1, 1, 1], False, MIN_MACHINES_ENV, "the launch is not elastic (python -m infra.launch --min_machines N)"),
        (["h1"], [1, 1, 1, 1], False, LAUNCH_STATUS_ENV, "the launch is not elastic (python -m infra.launch --min_machines N)"),
        (["h1", "h2"], [1, 1, 1, 1], False, None, "1 machine would be left, fewer than --min_machines 2"),
        (["h0"], [1, 1, 1, 1], False, None, "it serves the rendezvous at 10.0.0.10 (node 0)"),
        (["h1"], [1, 0, 1, 1], False, None, "the other machines' agents have no in-job restart left (--max_restarts)"),
        (["h1"], [1, 1, 1, 1], True, None, "replica groups leave the quorum by their group's exit"),
    ],
)
def test_a_job_goes_on_without_leaving_hosts_only_where_the_launch_can(elastic, leaving, restarts, replicas, unset, expected):
    if unset:
        elastic.delenv(unset)
    standings = [Standing(r, peer.host == "h0") for r, peer in zip(restarts, PEERS, strict=True)]  # h0 is node 0
    assert in_job_problem(PEERS, leaving, standings, replicas) == expected


def test_a_rank_knows_whether_its_machine_serves_the_rendezvous_by_address_or_name(monkeypatch):
    """Each rank tells of its own machine (gathered): no rank resolves another's name, which could differ by rank."""
    import socket

    from infra.hangs import my_addresses

    for mine in [socket.gethostname(), *my_addresses()]:  # SLURM gives node 0's host name; infra.launch an address
        monkeypatch.setenv(RENDEZVOUS_HOST_ENV, mine)
        assert standing().serves_rendezvous, mine
    monkeypatch.setenv(RENDEZVOUS_HOST_ENV, "192.0.2.77")  # TEST-NET-1: no machine's
    assert not standing().serves_rendezvous
    monkeypatch.delenv(RENDEZVOUS_HOST_ENV)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert standing() == Standing(2, False)


LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from infra.launch import watch_agent
    watch_agent(5.0, restarts=True)  # what infra.launch starts: it ends this process when its ranks ask
    rank = (
        "import os, sys, time; from infra.leave import end_launcher; rank = int(sys.argv[1]); time.sleep(1.5 * rank); "
        "asked = time.time(); ended = end_launcher(rank, 75, 'h1 leaves the job'); "
        "open(sys.argv[2] + f'/rank{rank}', 'w').write(f'{ended} {asked} {time.time()}')"
    )
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, "-c", rank, str(r), sys.argv[1]], env=env) for r in (0, 1)]
    time.sleep(60)  # an agent that would start them again: ended before
    print("not ended", flush=True)
    """
)


def test_a_launcher_ends_with_the_code_its_ranks_ask_for_once_each_has_asked_and_they_see_it_gone(tmp_path):
    """Two ranks of one host: the first asks at once, the second 1.5 s later; the launcher ends only then, with the
    code and the line asked for, and each rank sees it gone (its wait ends: True)."""
    start = time.time()
    cmd = [sys.executable, "-c", LAUNCHER, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1])
    assert proc.returncode == 75, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "launch: h1 leaves the job" and "not ended" not in proc.stdout
    deadline = time.monotonic() + 10
    while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    (ended0, asked0, seen0), (ended1, asked1, seen1) = ((tmp_path / f"rank{r}").read_text().split() for r in (0, 1))
    assert ended0 == ended1 == "True"
    assert float(seen0) >= float(asked1) > float(asked0) >= start  # rank 0 waited for rank 1's request


def test_a_rank_whose_launcher_does_not_end_withdraws_its_request(monkeypatch, tmp_path):
    monkeypatch.setenv(LAUNCH_STATUS_ENV, str(tmp_path))
    assert end_launcher(3, 75, "h1 leaves the job", wait=0.3) is False
    assert not list(tmp_path.iterdir())
    monkeypatch.delenv(LAUNCH_STATUS_ENV)
    assert end_launcher(3, 75, "h1 leaves the job", wait=0.3) is False  # not started by infra.launch: nothing to ask
