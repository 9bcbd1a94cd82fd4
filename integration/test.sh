#!/usr/bin/env bash
# berth's test command: installs what the tests need, checks formatting and lints, builds, and runs
# the test tiers (see shared/DESIGN.md, "Tests, in tiers").
#
# Usage: sudo integration/test.sh [--tier unit|fuzz|root|vm]...
#
#   --tier T   run only tier T (repeatable); default: every tier
#
# Steps, in order; the first that fails stops the run with a non-zero exit:
#   setup   integration/setup.sh (Debian packages, VM kernel)
#   fmt     cargo fmt --all -- --check
#   clippy  cargo clippy --workspace --all-targets -- -D warnings
#   deps    cargo machete (unused dependencies); cargo deny check licenses bans sources (deny.toml)
#   build   cargo build --workspace --all-targets
#   unit    cargo test --workspace --lib --bins
#   fuzz    bench/fuzz/run.sh 7: AFL++ on each fuzz target for 7 s (fails on a crash or hang)
#   root    cargo test --test root_* -- --ignored --test-threads=1   (every tests/root*.rs)
#   vm      cargo test --test vm -- --ignored --test-threads=1        (tests/vm.rs)
# setup, fmt, clippy, deps and build always run. A tier whose test file is missing, or that runs no
# test at all, fails: a tier that cannot run is a failure, never a skip.
# Honours CARGO_TARGET_DIR and the other cargo variables.
set -euo pipefail

usage() { sed -n '5,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

all_tiers=(unit fuzz root vm)
tiers=()
while [ $# -gt 0 ]; do
  case $1 in
    --tier)
      [ $# -ge 2 ] || { echo "test.sh: --tier needs a value: unit, fuzz, root or vm" >&2; exit 2; }
      case $2 in
        unit | fuzz | root | vm) tiers+=("$2") ;;
        *) echo "test.sh: unknown tier '$2' (expected unit, fuzz, root or vm)" >&2; exit 2 ;;
      esac
      shift 2 ;;
    --tier=*)
      set -- --tier "${1#--tier=}" "${@:2}" ;;
    -h | --help) usage; exit 0 ;;
    *) echo "test.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[ "${#tiers[@]}" -gt 0 ] || tiers=("${all_tiers[@]}")

if [ "$(id -u)" -ne 0 ]; then
  echo "test.sh: must run as root (setup installs packages; the root and VM tiers need root): sudo $0" >&2
  exit 1
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# sudo resets PATH; find the Rust toolchain where rustup puts it.
if ! command -v cargo >/dev/null; then
  for d in "${CARGO_HOME:-}/bin" "$HOME/.cargo/bin" /root/.cargo/bin \
    ${SUDO_USER:+"$(getent passwd "$SUDO_USER" | cut -d: -f6)/.cargo/bin"}; do
    if [ -x "$d/cargo" ]; then PATH="$d:$PATH"; break; fi
  done
  command -v cargo >/dev/null || { echo "test.sh: cargo not found in PATH or ~/.cargo/bin" >&2; exit 1; }
fi
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}
# tests/root_package.rs packages the build the other tests use: a release build would add ~15
# minutes of compiling to every run (packaging/build.sh builds release packages by default).
export BERTH_PACKAGE_PROFILE=${BERTH_PACKAGE_PROFILE:-dev}

# Steps to run, in order.
steps=(setup fmt clippy deps build)
for t in "${all_tiers[@]}"; do
  for w in "${tiers[@]}"; do
    if [ "$t" = "$w" ]; then steps+=("$t"); break; fi
  done
done

declare -A result seconds
tests_passed=0
tests_failed=0
log=$(mktemp /tmp/berth-test.XXXXXX)
current=""

summary() {
  local rc=$? s failed_step=""
  rm -f "$log"
  if [ -n "$current" ] && [ -z "${result[$current]:-}" ]; then
    result[$current]=failed # interrupted or died inside the step
  fi
  echo
  echo "==== summary ===="
  for s in "${steps[@]}"; do
    case ${result[$s]:-} in
      passed) printf '%-7s passed  %8s s\n' "$s" "${seconds[$s]}" ;;
      failed) printf '%-7s FAILED  %8s s\n' "$s" "${seconds[$s]:-?}"; failed_step=${failed_step:-$s} ;;
      *) printf '%-7s not run\n' "$s" ;;
    esac
  done
  echo "tests: $tests_passed passed, $tests_failed failed"
  if [ -n "$failed_step" ]; then
    echo "test.sh: FAILED at '$failed_step'"
    [ "$rc" -ne 0 ] || rc=1
  elif [ "$rc" -eq 0 ]; then
    echo "test.sh: all steps passed (${steps[*]})"
  else
    echo "test.sh: FAILED (exit $rc)"
  fi
  exit "$rc"
}
trap summary EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Test files of a tier, as cargo --test names: tests/NAME.rs or tests/NAME/main.rs.
test_targets() {
  local glob=$1 f
  for f in tests/$glob.rs tests/$glob/main.rs; do
    [ -f "$f" ] || continue
    f=${f#tests/}
    f=${f%/main.rs}
    echo "${f%.rs}"
  done | sort -u
}

# Runs `cargo test ARGS...`, shows its output, adds up its "test result:" lines, and fails if it
# fails or if it ran no test.
cargo_test() {
  local tier=$1 rc=0 p=0 f=0 line n
  shift
  echo "+ cargo test $*"
  cargo test "$@" 2>&1 | tee "$log" || rc=$?
  while IFS= read -r line; do
    n=${line#*. }; n=${n%% passed*}; p=$((p + n))
    n=${line#*passed; }; n=${n%% failed*}; f=$((f + n))
  done < <(grep -E '^test result: [A-Za-z]+\. [0-9]+ passed; [0-9]+ failed' "$log" || true)
  tests_passed=$((tests_passed + p))
  tests_failed=$((tests_failed + f))
  if [ "$rc" -ne 0 ]; then
    echo "$tier tier: cargo test failed (exit $rc; $p passed, $f failed)" >&2
    return 1
  fi
  if [ $((p + f)) -eq 0 ]; then
    local hint=""
    [ "$tier" = unit ] || hint=" (its tests must be #[ignore]d: this tier runs them with --ignored)"
    echo "$tier tier: ran no test, and a tier that runs nothing is a failure$hint" >&2
    return 1
  fi
}

step_setup() { bash integration/setup.sh; }
step_fmt() { cargo fmt --all -- --check; }
step_clippy() { cargo clippy --workspace --all-targets -- -D warnings; }
# Both read the manifests and Cargo.lock, not the build; setup installed them. No advisories: the
# RustSec database is cloned from GitHub, which the test machines do not reach (deny.toml).
step_deps() { cargo machete && cargo deny --workspace check licenses bans sources; }
step_build() { cargo build --workspace --all-targets; }
step_unit() { cargo_test unit --workspace --lib --bins; }

# Every fuzz target under AFL++ for a bounded time (every target of fuzz/corpus/, 18 today, x 7 s plus start-up: about 3
# minutes after the instrumented build); the unit tier already replayed each corpus file. A crash
# or a confirmed hang fails it.
step_fuzz() { bash bench/fuzz/run.sh "${BERTH_FUZZ_SECONDS:-7}"; }

step_root() {
  local t args=()
  while IFS= read -r t; do args+=(--test "$t"); done < <(test_targets 'root*')
  if [ "${#args[@]}" -eq 0 ]; then
    echo "root tier: no test files: expected tests/root*.rs (e.g. tests/root_cgroup.rs)" >&2
    return 1
  fi
  cargo_test root --no-fail-fast "${args[@]}" -- --ignored --test-threads=1
}

step_vm() {
  if [ -z "$(test_targets vm)" ]; then
    echo "vm tier: no test file: expected tests/vm.rs" >&2
    return 1
  fi
  cargo_test vm --no-fail-fast --test vm -- --ignored --test-threads=1
}

# Processes, other than this script and its ancestors, that hold a pipe this script writes its
# output to. CI reads the output until every writer has closed it, so a process that a test left
# behind holding it (a container init, a daemon started with inherited stdio) hangs CI after
# every step passed. Each is reported, ended by PID, and fails the step that left it.
stray_writers() {
  local fd link pipes=() ancestors=" " pid=$$ ppid flags holders=() p
  for fd in 1 2; do
    link=$(readlink "/proc/$$/fd/$fd") || continue
    # -lname takes a glob: the brackets of "pipe:[123]" must be literal.
    link=${link//\[/\\[}
    link=${link//\]/\\]}
    case $link in pipe:* | socket:*) pipes+=(-lname "$link" -o) ;; esac
  done
  [ "${#pipes[@]}" -gt 0 ] || return 0
  while [ "$pid" -gt 1 ]; do
    ancestors+="$pid "
    pid=$(awk '/^PPid:/ { print $2 }' "/proc/$pid/status" 2>/dev/null) || break
    [ -n "$pid" ] || break
  done
  while IFS= read -r p; do
    pid=${p#/proc/}; pid=${pid%%/*}
    # The reading end (the CI runner, a pipeline's reader) is no harm: only writers keep it open.
    flags=$(awk '/^flags:/ { print $2 }' "/proc/$pid/fdinfo/${p##*/}" 2>/dev/null) || continue
    [ -n "$flags" ] && [ $((8#$flags & 3)) -ne 0 ] || continue
    ppid=$(awk '/^PPid:/ { print $2 }' "/proc/$pid/status" 2>/dev/null) || continue
    # This script's own helpers right now (find, awk) are its children.
    [ "$ppid" = "$$" ] && continue
    case $ancestors in *" $pid "*) continue ;; esac
    case " ${holders[*]} " in *" $pid "*) continue ;; esac
    holders+=("$pid")
  done < <(find /proc/[0-9]*/fd -maxdepth 1 \( "${pipes[@]:0:${#pipes[@]}-1}" \) 2>/dev/null)
  [ "${#holders[@]}" -gt 0 ] || return 0
  echo "$1: these processes were left running holding test.sh's output (CI would wait for them forever); ending them:" >&2
  ps -o pid=,user=,args= -p "$(IFS=,; echo "${holders[*]}")" >&2 || true
  kill -TERM "${holders[@]}" 2>/dev/null || true
  sleep 1
  kill -KILL "${holders[@]}" 2>/dev/null || true
  return 1
}

# Mounts a step left inside the checkout: a checkout that cannot be removed afterwards (EBUSY)
# breaks whoever cleans up after the run. Each is reported, unmounted, and fails the step.
stray_mounts() {
  local m mounts=()
  while IFS= read -r m; do mounts+=("$m"); done < <(awk -v r="$root/" \
    'index($5, r) == 1 { print $5 }' /proc/self/mountinfo | sort -ru)
  [ "${#mounts[@]}" -gt 0 ] || return 0
  echo "$1: left mounted inside the checkout (a test did not clean up); unmounting:" >&2
  printf '  %s\n' "${mounts[@]}" >&2
  for m in "${mounts[@]}"; do umount -l "$m" 2>/dev/null || true; done
  return 1
}

for s in "${steps[@]}"; do
  current=$s
  echo
  echo "==== $s ===="
  start=$EPOCHREALTIME
  rc=0
  "step_$s" || rc=$?
  stray_writers "$s step" || rc=1
  stray_mounts "$s step" || rc=1
  end=$EPOCHREALTIME
  # EPOCHREALTIME is "seconds.microseconds"; print seconds with one decimal.
  us=$((${end/[.,]/} - ${start/[.,]/}))
  seconds[$s]=$(printf '%d.%d' $((us / 1000000)) $((us % 1000000 / 100000)))
  if [ "$rc" -eq 0 ]; then
    result[$s]=passed
    echo "==== $s passed in ${seconds[$s]} s ===="
  else
    result[$s]=failed
    echo "==== $s FAILED in ${seconds[$s]} s ===="
    exit 1
  fi
done
