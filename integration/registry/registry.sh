#!/usr/bin/env bash
# A throwaway OCI registry (Debian's docker-registry, distribution 2.8) on 127.0.0.1, for
# benchmarks and manual testing. The root-tier tests use the Rust harness next to this script
# (harness.rs), which starts the same registry the same ways.
#
# Usage:
#   registry.sh start DIR [--mode plain|basic|tls] [--port N] [--user U --password P] [--access-log]
#       Starts a registry whose storage, config, certificates and log live in DIR; prints
#       127.0.0.1:PORT when it answers. --access-log: one line per request in DIR/registry.log
#       (combined log format: status and bytes sent). basic: htpasswd (bcrypt) login U/P (default
#       berth/berth). tls: DIR/pki/ca.crt is the CA to trust (leaf SAN IP:127.0.0.1,
#       DNS:localhost). The PID is in DIR/registry.pid.
#   registry.sh stop DIR
#       Stops the registry started in DIR (by its PID).
set -euo pipefail

die() { echo "registry.sh: $*" >&2; exit 1; }
usage() { sed -n '6,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

make_pki() {
  local pki=$1
  mkdir -p "$pki"
  [ -f "$pki/leaf.crt" ] && return 0
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj /CN=berth-test-ca \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj /CN=localhost \
    -keyout "$pki/leaf.key" -out "$pki/leaf.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
    >"$pki/leaf.ext"
  openssl x509 -req -days 30 -CAcreateserial -in "$pki/leaf.csr" -CA "$pki/ca.crt" \
    -CAkey "$pki/ca.key" -extfile "$pki/leaf.ext" -out "$pki/leaf.crt" 2>/dev/null
}

start() {
  local dir=$1; shift
  local mode=plain port="" user=berth password=berth access_off=true
  while [ $# -gt 0 ]; do
    case $1 in
      --mode) mode=$2; shift 2 ;;
      --port) port=$2; shift 2 ;;
      --user) user=$2; shift 2 ;;
      --password) password=$2; shift 2 ;;
      --access-log) access_off=false; shift ;;
      *) die "unknown option '$1'" ;;
    esac
  done
  command -v docker-registry >/dev/null || die "docker-registry not found: apt-get install docker-registry"
  mkdir -p "$dir/storage"
  dir=$(cd "$dir" && pwd)
  if [ -f "$dir/registry.pid" ] && kill -0 "$(cat "$dir/registry.pid")" 2>/dev/null; then
    die "a registry already runs for $dir (PID $(cat "$dir/registry.pid")): registry.sh stop $dir"
  fi
  [ -n "$port" ] || port=$(free_port)
  {
    printf 'version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: %s\n' "$access_off"
    printf 'storage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\n' "$dir/storage"
    printf 'http:\n  addr: 127.0.0.1:%s\n' "$port"
    case $mode in
      plain) ;;
      tls)
        make_pki "$dir/pki"
        printf '  tls:\n    certificate: %s\n    key: %s\n' "$dir/pki/leaf.crt" "$dir/pki/leaf.key" ;;
      basic)
        command -v htpasswd >/dev/null || die "htpasswd not found: apt-get install apache2-utils"
        htpasswd -Bbn "$user" "$password" >"$dir/htpasswd"
        printf 'auth:\n  htpasswd:\n    realm: berth-test\n    path: %s\n' "$dir/htpasswd" ;;
      *) die "unknown mode '$mode' (plain, basic or tls)" ;;
    esac
  } >"$dir/config.yml"
  docker-registry serve "$dir/config.yml" >>"$dir/registry.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$dir/registry.pid"
  echo "$port" >"$dir/registry.port"
  local i
  for i in $(seq 1 200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "127.0.0.1:$port"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || die "docker-registry exited: $(tail -3 "$dir/registry.log")"
    sleep 0.05
  done
  kill "$pid" 2>/dev/null || true
  die "docker-registry did not answer on 127.0.0.1:$port in 10 s"
}

stop() {
  local dir=$1 pid
  [ -f "$dir/registry.pid" ] || return 0
  pid=$(cat "$dir/registry.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$dir/registry.pid"
}

case ${1:-} in
  start) [ $# -ge 2 ] || { usage >&2; exit 2; }; shift; start "$@" ;;
  stop) [ $# -eq 2 ] || { usage >&2; exit 2; }; stop "$2" ;;
  -h | --help) usage ;;
  *) usage >&2; exit 2 ;;
esac
