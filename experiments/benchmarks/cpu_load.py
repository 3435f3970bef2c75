"""What both sides of a benchmark (each in its own virtual environment) share, with no
dependencies: whether other processes used the CPU during a timed interval (this machine is
shared, and a step that waited for a core says nothing about the code; Linux /proc), and a
digest of a step's prompt token ids."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Snapshot:
    wall: float
    busy_s: float  # every core's non-idle time, all processes
    own_s: float  # user + system time of this process (every thread) and the live processes it started


def snapshot() -> Snapshot:
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice: guest time is inside user
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return Snapshot(time.perf_counter(), busy / TICKS, own_tree_seconds())


def own_tree_seconds() -> float:
    """User + system CPU seconds of this process and every live process it started (the vLLM
    servers a run launches are its own work, not another process's)."""
    parents, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        pid = int(entry)
        parents[pid] = int(fields[1])  # field 4 of stat: the parent; 14, 15: utime, stime
        cpu[pid] = (int(fields[11]) + int(fields[12])) / TICKS
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    return sum(cpu.get(pid, 0.0) for pid in tree)


def others_cores(start: Snapshot, end: Snapshot) -> float:
    """Cores that other processes kept busy on average between two snapshots of this process."""
    wall = max(end.wall - start.wall, 1e-9)
    return max(0.0, (end.busy_s - start.busy_s) - (end.own_s - start.own_s)) / wall


def prompt_digest(prompt_ids: list[list[int]]) -> str:
    """A short digest of a step's prompt token ids, to show two trainers were given the same prompts."""
    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompt_ids]).encode()).hexdigest()[:16]
