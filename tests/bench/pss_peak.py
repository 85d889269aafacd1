#!/usr/bin/python3
"""Run a command and measure the peak proportional set size (PSS) of each of
its processes, sampled every --every seconds from /proc/PID/smaps_rollup:
private memory plus each shared page divided by the processes that map it,
so a segment the ranks share is counted once across them, never hidden and
never counted once per rank.

  pss_peak.py [--every 0.1] [--min-mib 64] -- COMMAND ...

The command's output passes through; then one line:
  pss ranks=N max_mib=M mean_mib=A per_process=[...]
over the processes whose peak reached --min-mib (the ranks; a launcher
parent that only waits stays below it).  The exit status is the command's.
"""
import argparse
import os
import subprocess
import sys
import time


def children(pid):
    out = []
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            out = [int(c) for c in f.read().split()]
    except OSError:
        pass
    for c in list(out):
        out += children(c)
    return out


def pss_kib(pid):
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--every", type=float, default=0.1)
    p.add_argument("--min-mib", type=float, default=64)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    proc = subprocess.Popen(cmd)
    peak = {}
    while proc.poll() is None:
        for pid in [proc.pid] + children(proc.pid):
            peak[pid] = max(peak.get(pid, 0), pss_kib(pid))
        time.sleep(a.every)
    ranks = sorted((v / 1024.0 for v in peak.values() if v / 1024.0 >= a.min_mib), reverse=True)
    print("pss ranks=%d max_mib=%.1f mean_mib=%.1f per_process=[%s]" % (
        len(ranks), max(ranks) if ranks else 0, sum(ranks) / len(ranks) if ranks else 0,
        ", ".join("%.1f" % r for r in ranks)))
    sys.stdout.flush()
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
