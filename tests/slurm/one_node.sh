#!/usr/bin/env bash
# A real SLURM cluster of one node on this machine, to run infra/slurm/pretrain.sbatch as a cluster would
# (sbatch, srun, --requeue, --signal, scontrol requeue). Needs root and Debian's packages (slurm-wlm, munge:
# installed on first use). No cgroups, no accounting, no GPUs.
#   tests/slurm/one_node.sh up [DIR]     configure and start munged, slurmctld and slurmd; prints "SLURM up" when idle
#   tests/slurm/one_node.sh down [DIR]   stop the daemons this script started
# DIR (default /tmp/slurm-one-node) holds the configuration, state, logs and pid files.
set -euo pipefail
action=${1:-up}
dir=${2:-/tmp/slurm-one-node}

stop_daemons() {
    for daemon in slurmd slurmctld munged; do
        if [ -f "$dir/$daemon.pid" ]; then kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true; rm -f "$dir/$daemon.pid"; fi
    done
}

case "$action" in
    down) stop_daemons; echo "SLURM stopped"; exit 0 ;;
    up) ;;
    *) echo "usage: $0 up|down [DIR]" >&2; exit 2 ;;
esac

[ "$(id -u)" -eq 0 ] || { echo "SLURM needs root here" >&2; exit 1; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || { echo "no slurmctld/munged and no apt-get to install them" >&2; exit 1; }
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

mkdir -p "$dir/state" "$dir/spool" "$dir/log" /etc/slurm /etc/munge /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then head -c 1024 /dev/urandom >/etc/munge/munge.key; fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 400 /etc/munge/munge.key

host=$(hostname -s)
memory_mb=$(( $(awk '/^MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
cat >"$dir/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.own.pid
SlurmdPidFile=$dir/slurmd.own.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
KillWait=30
MinJobAge=600
ReturnToService=2
MpiDefault=none
NodeName=$host CPUs=$(nproc) RealMemory=$memory_mb State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
ln -sf "$dir/slurm.conf" /etc/slurm/slurm.conf

stop_daemons
if command -v setpriv >/dev/null; then
    setpriv --reuid munge --regid munge --clear-groups munged --foreground >"$dir/log/munged.out" 2>&1 &
else
    munged --foreground --force >"$dir/log/munged.out" 2>&1 &
fi
echo $! >"$dir/munged.pid"
sleep 1
slurmctld -D -f "$dir/slurm.conf" >"$dir/log/slurmctld.out" 2>&1 &
echo $! >"$dir/slurmctld.pid"
sleep 2
slurmd -D -f "$dir/slurm.conf" >"$dir/log/slurmd.out" 2>&1 &
echo $! >"$dir/slurmd.pid"
for _ in $(seq 60); do
    if sinfo -h -o %t 2>/dev/null | grep -q '^idle'; then echo "SLURM up: one node ($host, $(nproc) CPUs), logs in $dir/log"; exit 0; fi
    sleep 1
done
echo "SLURM did not come up; see $dir/log" >&2
exit 1
