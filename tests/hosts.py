"""Several hosts on one machine, for tests of what crosses a network: Linux network namespaces joined by a bridge.

    with Hosts(2) as hosts:               # hosts.names == ["h0", "h1"], hosts.addresses == ["10.231.0.10", ...]
        p = hosts.popen(0, ["accelerate", "launch", ...], env=..., log=path)
        hosts.kill(1)                     # SIGKILL to every process of host 1: a host lost
        hosts.link(1, up=False)           # host 1's interface down, its processes alive: a dead link

    with Hosts(4, cpus=0.6) as hosts:     # each host also held to 0.6 of a core (a CPU cgroup of its own)
        hosts.set_cpus(1, 0.3)            # host 1 slowed to half its share from now on (a throttled node)

Each host is a network namespace with its own loopback and one interface (`eth0`) on a bridge in a switch namespace
of its own, so nothing is added to the machine's own network. Its address comes from 10.231.0.0/24, used only inside
these namespaces. A process started on a host gets its own UTS namespace with the host's name as its hostname, and
`/etc/hosts` names every host (`ip netns exec` shows `/etc/netns/NS/hosts` as `/etc/hosts`): torch elastic's c10d
rendezvous decides by hostname which host serves its store. gloo is bound to `eth0` through `GLOO_SOCKET_IFNAME`.

With `cpus`, each host also gets a CPU cgroup of its own with that many cores' worth of time (a CFS quota; cgroup v1's
`cpu` controller or v2's `cpu.max`), which every process started on it joins: a host's speed then no longer depends on
whether the other hosts are busy, as on separate machines. Without it the hosts share the machine's cores, and a host
that dies leaves its cores to the others.

Every namespace, process, cgroup and file made is removed on leaving, on every exit path; namespaces left by a test process
that was killed are removed by the next `Hosts` (their names carry the creating pid). Root is needed: `Hosts.unavailable()`
says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.231.0"  # a /24 used only inside the namespaces made here
PREFIX = "infrahost"
INTERFACE = "eth0"
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")  # the cpu controller's hierarchy under cgroup v1
CGROUP_V2 = Path("/sys/fs/cgroup")  # the unified hierarchy, when it is mounted there
PERIOD_US = 10_000  # a CFS period of 10 ms: a host held to a share runs at it smoothly, not in 100 ms bursts


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Hosts:
    """`n` hosts named h0..h{n-1} at SUBNET.10, .11, ...; a context manager."""

    def __init__(self, n: int, cpus: float | None = None):
        if cpus is not None and not 0.01 <= cpus <= (os.cpu_count() or 1):
            raise ValueError(f"cpus={cpus} is not accepted: give a number of cores between 0.01 and {os.cpu_count()}")
        self.n, self.cpus = n, cpus
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}sw"
        self.namespaces = [f"{self.tag}h{i}" for i in range(n)]
        self.names = [f"h{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{10 + i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self.cgroups = [cgroup_root() / ns for ns in self.namespaces] if cpus is not None else []

    @staticmethod
    def unavailable(cpus: bool = False) -> str | None:
        """Why hosts (with `cpus`: hosts with CPU shares of their own) cannot be made here (None if they can)."""
        if cpus and not os.access(cgroup_root(), os.W_OK):
            return f"hosts with CPU shares need a writable cgroup cpu controller at {cgroup_root()}"
        if os.geteuid() != 0:
            return "network namespaces need root"
        if not shutil.which("ip") or not shutil.which("unshare"):
            return "the ip and unshare commands are needed (iproute2, util-linux)"
        probe = f"{PREFIX}probe{os.getpid()}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            return f"cannot make a network namespace here: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    # -- set-up and removal ------------------------------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        sweep_stale()
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _make(self) -> None:
        subprocess.run(["ip", "netns", "add", self.switch], check=True, capture_output=True)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names, strict=True))
        for i, ns in enumerate(self.namespaces):
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            peer = f"{self.tag[-6:]}p{i}"  # interface names are at most 15 characters
            _ip("link", "add", INTERFACE, "netns", ns, "type", "veth", "peer", "name", peer, "netns", self.switch)
            _ip("link", "set", peer, "master", "br0", ns=self.switch)
            _ip("link", "set", peer, "up", ns=self.switch)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("addr", "add", f"{self.addresses[i]}/24", "dev", INTERFACE, ns=ns)
            _ip("link", "set", INTERFACE, "up", ns=ns)
        for host, cgroup in enumerate(self.cgroups):
            cgroup.mkdir()
            self.set_cpus(host, self.cpus)

    def remove(self) -> None:
        """Every process on the hosts killed, then the namespaces and their files deleted."""
        for i in range(self.n):
            with contextlib.suppress(Exception):
                self.kill(i)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
        for ns in [*self.namespaces, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for cgroup in self.cgroups:
            remove_cgroup(cgroup)

    # -- what a test does to the hosts -------------------------------------------------------------------------------

    def popen(self, host: int, cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
        """`cmd` started on `host` (its hostname, its network, its CPU share, gloo bound to its interface), output to
        `log`."""
        env = {**env, "GLOO_SOCKET_IFNAME": INTERFACE, "TP_SOCKET_IFNAME": INTERFACE}
        wrapped = [
            "ip", "netns", "exec", self.namespaces[host],
            "unshare", "--uts", "sh", "-c", f'hostname {self.names[host]} && exec "$@"', "sh", *cmd,
        ]  # fmt: skip
        if self.cgroups:  # joined first: `ip netns exec` mounts a sysfs of the namespace's own, without the cgroups
            wrapped = ["sh", "-c", f'echo $$ > {self.cgroups[host] / "cgroup.procs"} && exec "$@"', "sh", *wrapped]
        with open(log, "w") as out:
            proc = subprocess.Popen(wrapped, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def set_cpus(self, host: int, cpus: float) -> None:
        """`host` held to `cpus` cores' worth of time from now on (hosts made with `cpus` only): a host slowed, or freed."""
        if not self.cgroups:
            raise ValueError("set_cpus needs hosts made with cpus=: they have no CPU cgroup")
        if not 0.01 <= cpus <= (os.cpu_count() or 1):
            raise ValueError(f"cpus={cpus} is not accepted: give a number of cores between 0.01 and {os.cpu_count()}")
        cgroup, quota = self.cgroups[host], str(round(cpus * PERIOD_US))
        if cgroup_root() == CGROUP_V1:
            (cgroup / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (cgroup / "cpu.cfs_quota_us").write_text(quota)
        else:  # the cpu controller must be on for the root's children (it is where systemd runs)
            with contextlib.suppress(OSError):
                (CGROUP_V2 / "cgroup.subtree_control").write_text("+cpu")
            (cgroup / "cpu.max").write_text(f"{quota} {PERIOD_US}")

    def pids(self, host: int) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.namespaces[host]], capture_output=True, text=True).stdout
        return [int(p) for p in listed.split()]

    def kill(self, host: int, sig: int = signal.SIGKILL) -> None:
        """`sig` to every process on `host` (SIGKILL: the host is lost)."""
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def link(self, host: int, up: bool) -> None:
        """`host`'s interface up or down (down: its processes live on, cut off from the others)."""
        _ip("link", "set", INTERFACE, "up" if up else "down", ns=self.namespaces[host])

    def wait_quiet(self, host: int, timeout: float) -> bool:
        """True once no process is left on `host`, False if some still run after `timeout` seconds."""
        end = time.monotonic() + timeout
        while self.pids(host):
            if time.monotonic() > end:
                return False
            time.sleep(0.2)
        return True


def cgroup_root() -> Path:
    """Where hosts' CPU cgroups are made: the v1 cpu controller's hierarchy, else the unified (v2) one."""
    return CGROUP_V1 if (CGROUP_V1 / "cgroup.procs").exists() else CGROUP_V2


def remove_cgroup(cgroup: Path) -> None:
    """`cgroup` removed once the processes in it have ended (killed already: their exit takes a moment)."""
    end = time.monotonic() + 10
    while cgroup.exists():
        try:
            cgroup.rmdir()
        except OSError:
            if time.monotonic() > end:
                return
            time.sleep(0.1)


def sweep_stale() -> None:
    """Remove the namespaces (and CPU cgroups) of earlier `Hosts` whose test process is gone (killed before it could
    clean up)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or name.startswith(f"{PREFIX}probe"):
            continue
        digits = "".join(c for c in name[len(PREFIX) :].split("h")[0].split("sw")[0] if c.isdigit())
        if digits and not _alive(int(digits)):
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
            remove_cgroup(cgroup_root() / name)
