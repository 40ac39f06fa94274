#!/usr/bin/env bash
# The new-connection cost of harvester-lb (kernel)'s table against the
# kernel's one-rule DNAT, measured so that a loaded machine's noise cancels:
# both run AT THE SAME TIME through one LB host, each with its own wrk
# (50 connections, `Connection: close`) from its own client source address,
# so every instant of load falls on both alike; the figure is the ratio of
# their connection counts per run (a rate measured alone, one target after
# the other, moves by more than the gap on a shared 2-core machine).
#
#   benches/forward-pair.sh [--runs N] [--duration S]   # root; 8 x 10 s default
#
# The bed is benches/compare.sh --only forward's: a client namespace, the LB
# host's namespace routing (ip_forward, the VIPs on lo), a backend namespace
# (the bench's own HTTP backend); the one-rule DNAT on 198.18.0.5, the daemon
# (forwarding = "kernel", source_nat = "none", one backend, as the bench)
# on 198.18.0.6. The daemon runs during every pair, so its presence is
# common to both; what differs is the table each flow crosses. Both tables
# are in force together: a one-rule flow also misses the daemon's dispatch
# map, a daemon flow also misses the one rule.
# Every address is inside the three namespaces this script makes; they and
# every process it starts are removed on exit (by pid and by name).
# Needs: a built harvester-lb and compare bench (CARGO_PROFILE=ci
# benches/compare.sh builds both into target/ci), nft, wrk, curl, bc.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=8
duration=10
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    *) echo "usage: $0 [--runs N] [--duration S]" >&2; exit 2 ;;
  esac
done
[[ $(id -u) == 0 ]] || { echo "$0: needs root (network namespaces, nft)" >&2; exit 1; }
profile=${CARGO_PROFILE:-ci}
target=${CARGO_TARGET_DIR:-target}/$profile
hlb=$target/harvester-lb
backend_bin=$(ls -t "$target"/deps/compare-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
[[ -x $hlb && -x $backend_bin ]] || {
  echo "$0: build first: CARGO_PROFILE=$profile benches/compare.sh --only forward --rounds 1 (or cargo bench --profile $profile --bench compare --no-run)" >&2
  exit 1
}

tag=fp$$
cl=$tag-c lb=$tag-l be=$tag-b
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for n in $cl $lb $be; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

for n in $cl $lb $be; do ip netns add "$n"; ip -n "$n" link set lo up; done
ip -n "$lb" link add fwdc0 type veth peer name eth0 netns "$cl"
ip -n "$lb" link add fwdb0 type veth peer name eth0 netns "$be"
ip -n "$lb" addr add 198.19.1.1/24 dev fwdc0
ip -n "$lb" addr add 198.19.2.1/24 dev fwdb0
ip -n "$lb" link set fwdc0 up
ip -n "$lb" link set fwdb0 up
ip -n "$lb" addr add 198.18.0.5/32 dev lo
ip -n "$lb" addr add 198.18.0.6/32 dev lo
ip netns exec "$lb" sysctl -qw net.ipv4.ip_forward=1
ip netns exec "$lb" sysctl -qw net.netfilter.nf_conntrack_tcp_timeout_time_wait=3 2>/dev/null || true
ip -n "$be" addr add 198.19.2.2/24 dev eth0
ip -n "$be" link set eth0 up
ip -n "$be" route add default via 198.19.2.1
ip -n "$cl" addr add 198.19.1.2/24 dev eth0
ip -n "$cl" link set eth0 up
ip -n "$cl" route add default via 198.19.1.1
# One client source per target: no shared 4-tuple at the backend (its
# TIME_WAIT sockets would refuse the other target's SYNs by PAWS).
ip -n "$cl" addr add 198.19.1.10/24 dev eth0
ip -n "$cl" addr add 198.19.1.11/24 dev eth0
ip -n "$cl" route add 198.18.0.5/32 via 198.19.1.1 src 198.19.1.10
ip -n "$cl" route add 198.18.0.6/32 via 198.19.1.1 src 198.19.1.11

ip netns exec "$be" "$backend_bin" --serve-http 198.19.2.2:18080 >"$work/backend.log" 2>&1 &
pids+=($!)

cat >"$work/hlb.toml" <<'EOF'
[admin]
listen = "198.18.0.6:19901"
[proxy]
drain_timeout_seconds = 1
[[load_balancer]]
name = "bench/kernel"
vip = "198.18.0.6"
backends = ["198.19.2.2"]
algorithm = "round_robin"
  [[load_balancer.listener]]
  name = "http"
  port = 18080
  backend_port = 18080
  protocol = "tcp"
  forwarding = "kernel"
  source_nat = "none"
  [load_balancer.health_check]
  port = 18080
  period_seconds = 1
  timeout_seconds = 1
EOF
ip netns exec "$lb" nft -f - <<'EOF'
table ip hlb_bench_fwd {
  chain pre {
    type nat hook prerouting priority -100; policy accept;
    ip daddr 198.18.0.5 tcp dport 18080 dnat to 198.19.2.2;
  }
}
EOF
ip netns exec "$lb" env HARVESTER_LB_LOG=warn "$hlb" run --no-watch --threads 1 \
  --config "$work/hlb.toml" >"$work/hlb.log" 2>&1 &
pids+=($!)

wait_for() { # what, command...: polls for 20 s
  local what=$1; shift
  for _ in $(seq 200); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "$0: $what not ready after 20 s; the daemon's log:" >&2; tail -5 "$work/hlb.log" >&2; exit 1
}
kernel_ready() { ip netns exec "$lb" curl -s -m1 http://198.18.0.6:19901/status | grep -q "\"forwarding\": *\"kernel\""; }
wait_for "the daemon's kernel listener" kernel_ready
wait_for "the one-rule DNAT" ip netns exec "$cl" curl -sf -m1 -o /dev/null http://198.18.0.5:18080/
wait_for "harvester-lb (kernel)" ip netns exec "$cl" curl -sf -m1 -o /dev/null http://198.18.0.6:18080/

paws() { ip netns exec "$be" awk '/^TcpExt:/{ if (!h) { for (i = 2; i <= NF; i++) if ($i == "PAWSTimewait") c = i; h = 1 } else print $c }' /proc/net/netstat; }
ratios=()
echo "harvester-lb (kernel) against the one-rule DNAT at the same time, $runs x ${duration}s, wrk -c50 each, Connection: close"
for r in $(seq "$runs"); do
  p0=$(paws)
  ip netns exec "$cl" wrk -t1 -c50 -d"${duration}s" -H 'Connection: close' http://198.18.0.5:18080/ >"$work/k.txt" 2>&1 &
  kpid=$!
  ip netns exec "$cl" wrk -t1 -c50 -d"${duration}s" -H 'Connection: close' http://198.18.0.6:18080/ >"$work/h.txt" 2>&1
  wait "$kpid"
  k=$(awk '/requests in/{print $1}' "$work/k.txt")
  h=$(awk '/requests in/{print $1}' "$work/h.txt")
  ratio=$(echo "scale=3; $h / $k" | bc)
  ratios+=("$ratio")
  echo "run $r: one-rule DNAT $k, harvester-lb (kernel) $h connections; ratio $ratio; backend PAWS refusals $(($(paws) - p0)); load $(cut -d' ' -f1 /proc/loadavg)"
done
printf '%s\n' "${ratios[@]}" | sort -g | awk '{ a[NR] = $1 } END { m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "harvester-lb (kernel) / one-rule DNAT: median %.3f, range %.3f-%.3f over %d runs\n", m, a[1], a[NR], NR }'
