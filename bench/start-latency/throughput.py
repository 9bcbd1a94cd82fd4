#!/usr/bin/env python3
"""Container starts per second with P starts in flight at once, per arm, interleaved.

Usage: throughput.py --parallel P --starts N --rounds R [--ratio A/B[:GOAL]]... NAME=JSON_ARGV...

Each NAME=JSON_ARGV is one arm, as measure.py takes them ("{id}" is replaced by a unique name).
A round runs every arm once, the first arm rotating from round to round; an arm's run starts N
commands, P at a time (P threads, each starting the next command as soon as its previous one
exited), and is timed from the first start to the last exit (time.perf_counter_ns). It prints
the median, min and max starts per second over the rounds per arm, and --ratio A/B[:GOAL]
prints median(A)/median(B) (arms named by their first word, as measure.py does). A command that
exits non-zero stops the benchmark with its stderr.
"""

import argparse
import itertools
import re
import statistics
import subprocess
import sys
import threading
import time

from measure import parse_arm


def run_arm(name, argv, parallel, starts):
    counter = itertools.count()
    failure = []

    def worker():
        while not failure:
            n = next(counter)
            if n >= starts:
                return
            cmd = [x.replace("{id}", f"berth-tput-{n}-{time.monotonic_ns()}") for x in argv]
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
            if p.returncode != 0:
                failure.append((cmd, p.returncode, p.stderr.decode(errors="replace").strip()))

    threads = [threading.Thread(target=worker) for _ in range(parallel)]
    t0 = time.perf_counter_ns()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t1 = time.perf_counter_ns()
    if failure:
        cmd, rc, err = failure[0]
        sys.exit(f"throughput: {name} failed (exit {rc}): {' '.join(cmd)}\n{err}")
    return starts / ((t1 - t0) / 1e9)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--starts", type=int, default=400, help="starts per arm and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ratio", action="append", default=[], help="A/B[:GOAL], repeatable")
    ap.add_argument("arms", nargs="+", type=parse_arm)
    a = ap.parse_args()
    if a.parallel < 1 or a.starts < 1 or a.rounds < 1:
        ap.error("--parallel, --starts and --rounds must be >= 1")

    rates = {n: [] for n, _ in a.arms}
    for r in range(a.rounds):
        for i in range(len(a.arms)):
            name, argv = a.arms[(r + i) % len(a.arms)]
            rates[name].append(run_arm(name, argv, a.parallel, a.starts))

    names = [n for n, _ in a.arms]
    width = max(28, max(len(n) for n in names) + 2)
    title = f"throughput ({a.parallel} in parallel, {a.starts} starts x {a.rounds} rounds)"
    print(f"{title:<{width + 10}}{'median':>10}{'min':>10}{'max':>10}")
    med = {}
    for n in names:
        v = rates[n]
        med[n] = statistics.median(v)
        print(f"{n:<{width + 10}}{med[n]:>8.0f}/s{min(v):>8.0f}/s{max(v):>8.0f}/s")
    short = {re.split(r"[ +]", n)[0]: n for n in names}
    for spec in a.ratio:
        pair, _, goal = spec.partition(":")
        x, _, y = pair.partition("/")
        if x not in short or y not in short:
            sys.exit(f"throughput: --ratio {spec}: no arm named {x if x not in short else y}")
        line = f"ratio {x}/{y} (starts/s): {med[short[x]] / med[short[y]]:.2f}x"
        print(line + (f"   (goal >= {goal})" if goal else ""))


if __name__ == "__main__":
    main()
