#!/usr/bin/env bash
# Fuzzes berth's parsers of outside input with AFL++ (cargo-afl), one target after another, and
# prints the executions, crashes and hangs of each.
#
# Usage: bench/fuzz/run.sh [SECONDS-PER-TARGET] [TARGET...]
#
#   SECONDS-PER-TARGET  how long afl-fuzz runs each target (default 600)
#   TARGET...           only these targets (default: every directory of fuzz/corpus)
#
# Environment:
#   FUZZ_OUT=DIR     afl-fuzz output directories go to DIR/TARGET (default: a new temporary
#                    directory, removed at the end unless something was found)
#   FUZZ_NO_BUILD=1  use the binary already built (cargo afl build --release -p berth-fuzz
#                    --features afl) instead of building it
#   CARGO_TARGET_DIR is honoured.
#
# Exits 1 if any target crashed, or hung in a way that a plain (uninstrumented, unloaded) replay
# confirms with a 10 s limit; each finding is listed with the command that replays it. Needs
# cargo-afl (integration/setup.sh installs it): without it the run fails, never skips.
set -euo pipefail

secs=${1:-600}
[[ $secs =~ ^[0-9]+$ ]] && [ "$secs" -gt 0 ] || {
  echo "run.sh: SECONDS-PER-TARGET must be a positive integer, not '$secs'" >&2
  exit 2
}
shift $(($# > 0 ? 1 : 0))

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
for d in "${CARGO_HOME:-}/bin" "$HOME/.cargo/bin" /root/.cargo/bin; do
  [ -x "$d/cargo" ] && PATH="$d:$PATH" && break
done
command -v cargo-afl >/dev/null || {
  echo "run.sh: cargo-afl not found: run integration/setup.sh (it installs it with cargo install)" >&2
  exit 1
}

targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
  for d in fuzz/corpus/*/; do targets+=("$(basename "$d")"); done
fi

target_dir=${CARGO_TARGET_DIR:-$root/target}
# An AFL build differs from a plain one in RUSTFLAGS: keep it apart so neither rebuilds the other.
afl_target_dir=$target_dir/afl
bin=$afl_target_dir/release/berth-fuzz
replay=$afl_target_dir/release/berth-fuzz-replay
if [ -z "${FUZZ_NO_BUILD:-}" ]; then
  echo "+ cargo afl build --release -p berth-fuzz --features afl"
  CARGO_TARGET_DIR=$afl_target_dir cargo afl build --release -p berth-fuzz --features afl
fi
[ -x "$bin" ] || { echo "run.sh: $bin not built" >&2; exit 1; }

out=${FUZZ_OUT:-}
keep=1
if [ -z "$out" ]; then
  out=$(mktemp -d /tmp/berth-fuzz.XXXXXX)
  keep=0
fi
mkdir -p "$out"

# afl-fuzz: no UI; no CPU binding (other jobs share the machine's cores); no core_pattern or
# governor demands; quick calibration; no update check.
export AFL_NO_UI=1 AFL_NO_AFFINITY=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 \
  AFL_FAST_CAL=1 AFL_NO_STARTUP_CALIBRATION=1 AFL_IGNORE_SEED_PROBLEMS=1

stat() { awk -F' *: *' -v k="$1" '$1 == k { print $2 }' "$2" 2>/dev/null; }

failed=0
total_execs=0
printf '%-16s %12s %8s %6s %6s %s\n' target executions exec/s crashes hangs corpus
for t in "${targets[@]}"; do
  [ -d "fuzz/corpus/$t" ] || { echo "run.sh: no corpus fuzz/corpus/$t" >&2; exit 2; }
  rm -rf "${out:?}/$t"
  # -V: fuzz for this long; -t: a run over 2 s is a hang (parsers take microseconds; the slack is
  # for a loaded machine); -m: 2 GiB of address space, so unbounded allocation is a crash.
  # afl-fuzz's own output goes to a log; the table says what matters.
  cargo afl fuzz -V "$secs" -t 2000 -m 2048 -i "fuzz/corpus/$t" -o "$out/$t" -- "$bin" "$t" \
    >"$out/$t.log" 2>&1 || true
  stats=$out/$t/default/fuzzer_stats
  if [ ! -f "$stats" ]; then
    echo "run.sh: afl-fuzz did not run target $t; the end of its log ($out/$t.log):" >&2
    tail -20 "$out/$t.log" >&2
    keep=1
    failed=1
    continue
  fi
  execs=$(stat execs_done "$stats")
  crashes=$(stat saved_crashes "$stats")
  hangs=$(stat saved_hangs "$stats")
  speed=$(stat execs_per_sec "$stats")
  corpus=$(stat corpus_count "$stats")
  total_execs=$((total_execs + execs))
  printf '%-16s %12s %8s %6s %6s %s\n' "$t" "$execs" "${speed%%.*}" "$crashes" "$hangs" "$corpus"
  if [ "${crashes:-0}" -gt 0 ]; then
    failed=1
    keep=1
    for f in "$out/$t"/default/crashes/id:*; do
      echo "  crash: $f"
      echo "    replay: $replay $t '$f'"
    done
  fi
  if [ "${hangs:-0}" -gt 0 ]; then
    for f in "$out/$t"/default/hangs/id:*; do
      if timeout 10 "$replay" "$t" "$f" >/dev/null 2>&1; then
        echo "  slow under load, not a hang (replays in < 10 s): $f"
      else
        failed=1
        keep=1
        echo "  hang: $f (replay exceeds 10 s or fails)"
        echo "    replay: $replay $t '$f'"
      fi
    done
  fi
done
echo "total executions: $total_execs"
if [ "$keep" -eq 1 ]; then
  echo "afl-fuzz output kept in $out"
else
  rm -rf "$out"
fi
if [ "$failed" -ne 0 ]; then
  echo "run.sh: FAILED: a target crashed or hung (above); add the input to fuzz/corpus/TARGET/ with the fix" >&2
  exit 1
fi
echo "run.sh: no crash, no hang"
