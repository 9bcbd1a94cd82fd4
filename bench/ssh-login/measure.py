#!/usr/bin/env python3
"""Times `ssh node true` against several sshd arms, interleaved; prints medians, ratios, added ms.

Usage: measure.py --rounds N [--warmup W] [--pair A/B]... NAME=JSON_ARGV...

Each NAME=JSON_ARGV is one arm: a label (its first word names it in --pair) and the client
command as a JSON list. Every round runs each arm once; the arm that goes first moves by one each
round, so no arm always follows another. A login is timed from just before the fork to just after
the wait (time.perf_counter_ns, a monotonic clock). A command that exits non-zero stops the
benchmark with its stderr. --pair A/B prints median(A)/median(B) and median(A) - median(B).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time


def parse_arm(text):
    name, sep, argv = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=JSON_ARGV, got {text!r}")
    argv = json.loads(argv)
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise argparse.ArgumentTypeError(f"{name}: argv must be a non-empty JSON list of strings")
    return name, argv


def percentile(values, p):
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pair", action="append", default=[])
    ap.add_argument("arms", nargs="+", type=parse_arm)
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    names = [n for n, _ in a.arms]
    times = {n: [] for n in names}
    for r in range(a.warmup + a.rounds):
        for i in range(len(a.arms)):
            name, argv = a.arms[(r + i) % len(a.arms)]
            t0 = time.perf_counter_ns()
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
            t1 = time.perf_counter_ns()
            if p.returncode != 0:
                err = p.stderr.decode(errors="replace").strip()
                sys.exit(f"ssh-login: {name} failed (exit {p.returncode}): {' '.join(argv)}\n{err}")
            if r >= a.warmup:
                times[name].append((t1 - t0) / 1e6)
    width = max(len(n) for n in names) + 2
    print(f"{'ssh node true (N=%d, interleaved)' % a.rounds:<{width}}"
          f"{'median':>10}{'p10':>10}{'p90':>10}{'min':>10}")
    med = {}
    for n in names:
        v = times[n]
        med[n] = statistics.median(v)
        print(f"{n:<{width}}{med[n]:>7.1f} ms{percentile(v, 10):>7.1f} ms"
              f"{percentile(v, 90):>7.1f} ms{min(v):>7.1f} ms")
    short = {n.split()[0]: n for n in names}
    for spec in a.pair:
        x, _, y = spec.partition("/")
        if x not in short or y not in short:
            sys.exit(f"ssh-login: --pair {spec}: no arm named {x if x not in short else y}")
        mx, my = med[short[x]], med[short[y]]
        print(f"{x}/{y}: {mx / my:.2f}x, {mx - my:+.1f} ms")


if __name__ == "__main__":
    main()
