#!/usr/bin/env python3
"""Times container starts of several tools, interleaved, and prints median/p10/p90 and ratios.

Usage: measure.py --rounds N [--warmup W] [--cleanup CMD] [--ratio A/B[:GOAL]]... NAME=JSON_ARGV...

Each NAME=JSON_ARGV is one arm: a label and the command as a JSON list. "{id}" in an argument is
replaced by a name unique to each run (for runc's container id). Every round runs each arm once;
the arm that goes first moves by one each round, so no tool always runs right after another.
A run is timed from just before the fork to just after the wait (time.perf_counter_ns, a
monotonic clock). A command that exits non-zero stops the benchmark with its stderr.
--cleanup CMD (a JSON list, "{id}" replaced) runs after a failed run of an arm whose argv uses
"{id}", e.g. `runc delete -f {id}`.
--ratio A/B[:GOAL] prints median(A)/median(B), where A and B are the first words of arm names
(split at a space or "+"), with the goal if given.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time


def parse_arm(text):
    name, sep, argv = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=JSON_ARGV, got {text!r}")
    try:
        argv = json.loads(argv)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{name}: argv is not JSON: {e}") from e
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise argparse.ArgumentTypeError(f"{name}: argv must be a non-empty JSON list of strings")
    return name, argv


def percentile(values, p):
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    ap.add_argument("--cleanup", type=json.loads, default=None)
    ap.add_argument("--ratio", action="append", default=[], help="A/B[:GOAL], repeatable")
    ap.add_argument("arms", nargs="+", type=parse_arm)
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")

    names = [n for n, _ in a.arms]
    times = {n: [] for n in names}
    seq = 0

    def run(name, argv):
        nonlocal seq
        seq += 1
        uid = f"berth-bench-{os.getpid()}-{seq}"
        cmd = [x.replace("{id}", uid) for x in argv]
        t0 = time.perf_counter_ns()
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
        t1 = time.perf_counter_ns()
        if p.returncode != 0:
            if a.cleanup and any("{id}" in x for x in argv):
                subprocess.run([x.replace("{id}", uid) for x in a.cleanup],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            err = p.stderr.decode(errors="replace").strip()
            sys.exit(f"start-latency: {name} failed (exit {p.returncode}): {' '.join(cmd)}\n{err}")
        return t1 - t0

    for r in range(a.warmup + a.rounds):
        for i in range(len(a.arms)):
            name, argv = a.arms[(r + i) % len(a.arms)]
            ns = run(name, argv)
            if r >= a.warmup:
                times[name].append(ns / 1e6)

    width = max(28, max(len(n) for n in names) + 2)
    print(f"{'start-latency (N=%d, interleaved)' % a.rounds:<{width + 10}}"
          f"{'median':>9}{'p10':>9}{'p90':>9}{'min':>9}")
    med = {}
    for n in names:
        v = times[n]
        med[n] = statistics.median(v)
        print(f"{n:<{width + 10}}{med[n]:>6.2f} ms{percentile(v, 10):>6.2f} ms"
              f"{percentile(v, 90):>6.2f} ms{min(v):>6.2f} ms")
    short = {re.split(r"[ +]", n)[0]: n for n in names}
    for spec in a.ratio:
        pair, _, goal = spec.partition(":")
        x, _, y = pair.partition("/")
        if x not in short or y not in short:
            sys.exit(f"start-latency: --ratio {spec}: no arm named {x if x not in short else y}")
        line = f"ratio {x}/{y}: {med[short[x]] / med[short[y]]:.2f}x"
        print(line + (f"   (goal <= {goal}x)" if goal else ""))


if __name__ == "__main__":
    main()
