#!/usr/bin/env bash
# System calls per request, harvester-lb beside HAProxy and the nginx stream
# module: a new connection per request (`Connection: close`) and a kept-alive
# request. Counts, not times, so a busy machine does not change them.
#
# Each proxy runs alone on one thread, in front of one nginx backend that
# answers 3 bytes; wrk drives 10 connections for SECONDS; `strace -c -f`
# counts every system call of the proxy meanwhile. Loopback only
# (127.0.50.0/24).
#
# TCP segments per request are the `nstat` delta of TcpOutSegs over the wrk
# run, divided by its requests: every segment on every leg (wrk to proxy,
# proxy to backend, and back), each counted once. The script runs itself in
# a network namespace of its own (`unshare --net`), so the counters hold this
# bench's segments alone, not those of whatever else the host is doing.
#
# strace slows the proxy enough that a client's request is always queued
# before the proxy's first read, so calls that find nothing (EAGAIN: a
# wake-up or a guess without work) show only at full speed. A second wrk run
# per line counts with tracepoints instead (`perf stat`, no ptrace): every
# system call, and the EAGAIN returns of the calls that move data or accept.
#
# HLB_LISTENER adds lines to harvester-lb's listener, to count what an
# option changes: HLB_LISTENER='defer_accept_seconds = 5' benches/syscalls.sh
#
# Usage: benches/syscalls.sh [SECONDS]   (default 3; needs root for strace
# -p and unshare, and strace, wrk, nginx with libnginx-mod-stream, haproxy,
# nstat)
set -euo pipefail
secs=${1:-3}
if [[ -z ${HLB_SYSCALLS_NETNS:-} ]]; then
    command -v unshare >/dev/null || { echo "syscalls.sh: unshare is missing" >&2; exit 1; }
    HLB_SYSCALLS_NETNS=1 exec unshare --net -- "$BASH" "${BASH_SOURCE[0]}" "$@"
fi
ip link set lo up
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/hlb-syscalls.XXXXXX")
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

for tool in strace wrk nginx haproxy curl nstat perf; do
    command -v "$tool" >/dev/null || { echo "syscalls.sh: $tool is missing" >&2; exit 1; }
done
(cd "$repo" && cargo build --release --quiet --bin harvester-lb)
hlb=${CARGO_TARGET_DIR:-$repo/target}/release/harvester-lb

backend=127.0.50.2
cat >"$work/backend.conf" <<EOF
worker_processes 1; daemon off; master_process off;
pid $work/backend.pid; error_log $work/backend.err;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000;
  server { listen $backend:18080 backlog=4096; location / { return 200 "ok\n"; } } }
EOF
cat >"$work/hlb.toml" <<EOF
[admin]
listen = "127.0.50.1:19901"
socket = "$work/admin.sock"
[[load_balancer]]
name = "bench/syscalls"
vip = "127.0.50.1"
backends = ["$backend"]
  [[load_balancer.listener]]
  name = "http"
  port = 18080
  backend_port = 18080
  ${HLB_LISTENER:-}
EOF
cat >"$work/haproxy.cfg" <<EOF
global
  nbthread 1
  maxconn 7000
defaults
  mode tcp
  timeout connect 3s
  timeout client 1h
  timeout server 1h
frontend f
  bind 127.0.50.3:18080
  default_backend b
backend b
  server s1 $backend:18080
EOF
cat >"$work/nginx.conf" <<EOF
load_module /usr/lib/nginx/modules/ngx_stream_module.so;
worker_processes 1; daemon off; master_process off;
pid $work/nginx.pid; error_log $work/nginx.err;
events { worker_connections 4096; }
stream { server { listen 127.0.50.4:18080; proxy_pass $backend:18080; } }
EOF

nginx -c "$work/backend.conf" & pids+=($!)

# measure NAME IP MODE -- COMMAND...: one line of per-request counts.
measure() {
    local name=$1 ip=$2 mode=$3; shift 4
    "$@" >"$work/$name.log" 2>&1 & local proxy=$!
    pids+=("$proxy")
    local up=
    for _ in $(seq 1 100); do
        if curl -sf "http://$ip:18080/" >/dev/null; then up=1; break; fi
        sleep 0.1
    done
    [[ -n $up ]] || { echo "$name did not serve; log:"; cat "$work/$name.log"; exit 1; }
    local header=()
    [[ $mode == close ]] && header=(-H "Connection: close")
    strace -c -f -p "$proxy" -o "$work/$name.$mode.strace" 2>/dev/null & local tracer=$!
    sleep 0.5
    local out requests segs_before segs_after
    segs_before=$(out_segs)
    out=$(wrk -t1 -c10 -d"${secs}s" "${header[@]}" "http://$ip:18080/" 2>&1)
    segs_after=$(out_segs)
    requests=$(awk '/requests in/ {print $1}' <<<"$out")
    kill -INT "$tracer"; wait "$tracer" 2>/dev/null || true
    # The same load at full speed, counted by tracepoints.
    local eagain=() call
    for call in recvfrom read readv sendto write writev accept4 splice; do
        eagain+=(-e "syscalls:sys_exit_$call" --filter 'ret == -11')
    done
    perf stat -x, -e 'syscalls:sys_enter_*' "${eagain[@]}" -p "$proxy" -o "$work/$name.$mode.perf" & tracer=$!
    sleep 0.5
    out=$(wrk -t1 -c10 -d"${secs}s" "${header[@]}" "http://$ip:18080/" 2>&1)
    local fast
    fast=$(awk '/requests in/ {print $1}' <<<"$out")
    kill -INT "$tracer"; wait "$tracer" 2>/dev/null || true
    kill "$proxy"; wait "$proxy" 2>/dev/null || true
    local perf
    perf=$(awk -F, -v r="$fast" '
        $1 ~ /^[0-9]+$/ && $3 ~ /sys_enter_/ { all += $1 }
        $1 ~ /^[0-9]+$/ && $3 ~ /sys_exit_/ { again += $1 }
        END { printf "%.2f | %.2f", all / r, again / r }' "$work/$name.$mode.perf")
    awk -v r="$requests" -v n="$name" -v m="$mode" -v segs=$((segs_after - segs_before)) -v perf="$perf" '
        NR > 2 && $NF != "total" && $4 ~ /^[0-9]+$/ { total += $4; if ($4 / r >= 0.05) calls = calls sprintf(" %s %.2f", $NF, $4 / r) }
        END { printf "| %s | %s | %d | %.2f | %.2f |%s | %s |\n", n, m, r, segs / r, total / r, calls, perf }' "$work/$name.$mode.strace"
}

# out_segs: TCP segments sent in this namespace so far (absolute, not reset).
out_segs() { nstat -az TcpOutSegs | awk '$1 == "TcpOutSegs" { print $2 }'; }

echo "| proxy | request | requests | TCP segments per request | system calls per request | of which (>= 0.05) | at full speed (perf): calls | of which EAGAIN |"
echo "|---|---|---:|---:|---:|---|---:|---:|"
for mode in close keep; do
    measure harvester-lb 127.0.50.1 "$mode" -- "$hlb" run --config "$work/hlb.toml" --no-watch --threads 1
    measure haproxy 127.0.50.3 "$mode" -- haproxy -db -f "$work/haproxy.cfg"
    measure nginx 127.0.50.4 "$mode" -- nginx -c "$work/nginx.conf"
done
