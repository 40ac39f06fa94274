#!/usr/bin/env bash
# What a restart costs (issue 41), in one run on loopback: harvester-lb and
# HAProxy each restarted (harvester-lb) or reloaded onto its own binary
# (HAProxy) while benches/restart_probe.py holds 10 long connections (a line
# every 100 ms) and opens a new connection every 10 ms through it:
#
#   hlb-drain     harvester-lb as `systemctl restart` runs it today: SIGTERM
#                 (the drain, proxy.drain_timeout_seconds, default 30 s),
#                 wait for the exit, start again
#   hlb-handover  harvester-lb's hand-over: `harvester-lb prepare-stop
#                 --restart`, then the same SIGTERM and start, under
#                 benches/fd_store_holder.py (systemd's fd store as
#                 systemd 252 keeps it across a restart; PID 1 here is not
#                 systemd). Left out, saying so, while the binary has no
#                 prepare-stop (before issue 41's hand-over is merged)
#   haproxy-sf    `haproxy -D -sf OLDPID`: the new process binds its own
#                 listeners, the old one unbinds and serves its connections
#                 to their end
#   haproxy-x     the same with `-x STATS_SOCKET` and `expose-fd listeners`:
#                 the new process takes the old one's listening sockets
#
#   benches/restart.sh [--rounds N] [--new-ms MS] [--drain S] [--only LIST] [--json FILE]
#
# Figures per target (median over the rounds when N > 1): new connections
# refused, reset (ECONNRESET, or EOF before the answer), timed out (3 s),
# the window (first failed new connection to the end of the last, ms), the
# slowest answered one, long connections kept of 10, and how long the
# restart command took. Then the ratios to haproxy-x where both are non-zero.
#
# Env: HLB_BIN (default: target/release/harvester-lb, else target/ci/,
#      else target/debug/: say which in the figures you publish).
# Everything listens on 127.0.41.0/24; every process is this script's and
# is stopped by its pid at exit.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=1
new_ms=10
drain=30
only=hlb-drain,hlb-handover,haproxy-sf,haproxy-x
json=
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --new-ms) new_ms=$2; shift 2 ;;
    --drain) drain=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --json) json=$2; shift 2 ;;
    *) echo "usage: $0 [--rounds N] [--new-ms MS] [--drain S] [--only LIST] [--json FILE]" >&2; exit 2 ;;
  esac
done

target_dir=${CARGO_TARGET_DIR:-target}
hlb=${HLB_BIN:-}
if [[ -z $hlb ]]; then
  for p in release ci debug; do
    [[ -x $target_dir/$p/harvester-lb ]] && { hlb=$target_dir/$p/harvester-lb; break; }
  done
fi
[[ -n $hlb && -x $hlb ]] || { echo "$0: no harvester-lb binary (cargo build --release, or HLB_BIN=...)" >&2; exit 1; }
command -v haproxy >/dev/null || { echo "$0: haproxy missing (apt-get install haproxy)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "$0: python3 missing" >&2; exit 1; }
probe=$PWD/benches/restart_probe.py
holder=$PWD/benches/fd_store_holder.py

work=$(mktemp -d "${TMPDIR:-/tmp}/restart-bench.XXXXXX")
pids=()
cleanup() {
  set +e
  for f in "$work"/*.pids; do
    [[ -f $f ]] && while read -r p; do kill "$p" 2>/dev/null; done <"$f"
  done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  sleep 0.5
  for f in "$work"/*.pids; do
    [[ -f $f ]] && while read -r p; do kill -9 "$p" 2>/dev/null; done <"$f"
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

backend=127.0.41.2:30081
python3 "$probe" serve --tcp "$backend" --tag backend >"$work/backend.log" 2>&1 &
pids+=($!)

# wait_port IP:PORT SECS: until a TCP connect succeeds.
wait_port() {
  python3 - "$1" "$2" <<'EOF'
import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.05)
sys.exit(1)
EOF
}
wait_port "$backend" 10 || { echo "$0: the backend did not start" >&2; exit 1; }

hlb_config() { # $1 VIP, $2 admin port, $3 name
  cat <<EOF
[admin]
listen = "127.0.41.1:$2"
socket = "$work/$3/admin.sock"

[proxy]
drain_timeout_seconds = $drain

[[load_balancer]]
name = "bench/$3"
vip = "$1"
backends = ["127.0.41.2"]

  [[load_balancer.listener]]
  name = "echo"
  port = 8081
  backend_port = 30081
EOF
}
haproxy_config() { # $1 VIP, $2 stats socket line
  cat <<EOF
global
  maxconn 4000
  $2
defaults
  mode tcp
  timeout connect 3s
  timeout client 120s
  timeout server 120s
frontend fe
  bind $1:8081
  default_backend be
backend be
  server s1 $backend
EOF
}

# Each target: setup_<t> starts it (and writes $work/<t>.action, the
# restart command the probe runs); the probe's figures go to
# $work/<t>-<round>.json.
setup_hlb_drain() {
  local d=$work/hlb-drain
  mkdir -p "$d" && chmod 700 "$d"
  hlb_config 127.0.41.10 9911 hlb-drain >"$d/config.toml"
  cat >"$d/start.sh" <<EOF
setsid "$hlb" run --config "$d/config.toml" >>"$d/log" 2>&1 </dev/null &
echo \$! >"$d/pid"
echo \$! >>"$work/hlb-drain.pids"
EOF
  cat >"$work/hlb-drain.action" <<EOF
set -e
pid=\$(cat "$d/pid")
kill -TERM "\$pid"
# Until it is gone (a zombie counts as gone), at most drain + 30 s.
for _ in \$(seq 1 $(((drain + 30) * 20))); do
  s=\$(ps -o stat= -p "\$pid" 2>/dev/null) || break
  [[ \$s == Z* ]] && break
  sleep 0.05
done
bash "$d/start.sh"
EOF
  bash "$d/start.sh"
  wait_port 127.0.41.10:8081 30
}
setup_hlb_handover() {
  local d=$work/hlb-handover
  mkdir -p "$d" && chmod 700 "$d"
  hlb_config 127.0.41.11 9912 hlb-handover >"$d/config.toml"
  setsid python3 "$holder" --ready-file "$d/ready" -- "$hlb" run --config "$d/config.toml" >>"$d/log" 2>&1 </dev/null &
  echo $! >>"$work/hlb-handover.pids"
  local holder_pid=$!
  cat >"$work/hlb-handover.action" <<EOF
set -e
"$hlb" prepare-stop --restart --config "$d/config.toml"
old=\$(cat "$d/ready")
kill -HUP $holder_pid
# Until the next daemon says READY=1, at most 60 s.
for _ in \$(seq 1 1200); do
  [[ \$(cat "$d/ready") != "\$old" ]] && exit 0
  sleep 0.05
done
echo "no READY=1 from the next daemon within 60 s" >&2
exit 1
EOF
  for _ in $(seq 1 600); do [[ -s $d/ready ]] && break; sleep 0.05; done
  wait_port 127.0.41.11:8081 30
}
setup_haproxy() { # $1 name, $2 VIP, $3 stats line, $4 extra reload flags
  local d=$work/$1
  mkdir -p "$d"
  haproxy_config "$2" "$3" >"$d/haproxy.cfg"
  haproxy -D -f "$d/haproxy.cfg" -p "$d/pid"
  cat "$d/pid" >>"$work/$1.pids"
  cat >"$work/$1.action" <<EOF
set -e
old=\$(cat "$d/pid")
haproxy -D -f "$d/haproxy.cfg" -p "$d/pid" $4 -sf \$old
cat "$d/pid" >>"$work/$1.pids"
EOF
  wait_port "$2:8081" 10
}
setup_haproxy_sf() { setup_haproxy haproxy-sf 127.0.41.20 "stats socket $work/haproxy-sf/stats.sock mode 600 level admin" ""; }
setup_haproxy_x() {
  setup_haproxy haproxy-x 127.0.41.21 "stats socket $work/haproxy-x/stats.sock mode 600 level admin expose-fd listeners" \
    "-x $work/haproxy-x/stats.sock"
}
vip_of() { case $1 in hlb-drain) echo 127.0.41.10 ;; hlb-handover) echo 127.0.41.11 ;; haproxy-sf) echo 127.0.41.20 ;; haproxy-x) echo 127.0.41.21 ;; esac; }

targets=()
for t in ${only//,/ }; do
  if [[ $t == hlb-handover ]] && ! "$hlb" prepare-stop --help >/dev/null 2>&1; then
    echo "note: hlb-handover left out: $hlb has no prepare-stop (issue 41's hand-over not in this binary)"
    continue
  fi
  targets+=("$t")
done

echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), open files $(ulimit -n); $("$hlb" --version 2>/dev/null | head -n1) ($hlb); $(haproxy -v | head -n1 | cut -d' ' -f1-3)"
echo "load: 10 long connections (a line every 100 ms), a new connection every $new_ms ms; harvester-lb drain_timeout_seconds = $drain"
for t in "${targets[@]}"; do
  "setup_${t//-/_}"
done
for ((r = 1; r <= rounds; r++)); do
  for t in "${targets[@]}"; do
    printf '%-13s round %d: ' "$t" "$r"
    python3 "$probe" run --tcp "$(vip_of "$t"):8081" --long 10 --line-ms 100 --new-ms "$new_ms" \
      --before 2 --after 3 --action-timeout $((drain + 90)) --json "$work/$t-$r.json" -- bash "$work/$t.action"
  done
done

python3 - "$work" "$rounds" "${json:-}" "${targets[@]}" <<'EOF'
import json, statistics, sys
work, rounds, out, targets = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
rows = {}
for t in targets:
    runs = [json.load(open(f"{work}/{t}-{r}.json")) for r in range(1, rounds + 1)]
    med = lambda get: statistics.median(get(f) for f in runs)
    rows[t] = {
        "new": med(lambda f: f["new"]["total"]),
        "refused": med(lambda f: f["new"]["refused"]),
        "reset": med(lambda f: f["new"]["reset"]),
        "timeout": med(lambda f: f["new"]["timeout"] + f["new"]["other"]),
        "window_ms": med(lambda f: f["window_ms"]),
        "slowest_ok_ms": med(lambda f: f["slowest_ok_ms"] or 0),
        "long_kept": med(lambda f: f["long"]["kept"]),
        "restart_ms": med(lambda f: f["action_ms"]),
        "runs": runs,
    }
cols = ["new", "refused", "reset", "timeout", "window_ms", "slowest_ok_ms", "long_kept", "restart_ms"]
print()
print("| target | " + " | ".join(c.replace("_", " ") for c in cols) + " |")
print("|" + " --- |" * (len(cols) + 1))
for t, r in rows.items():
    print(f"| {t} | " + " | ".join(f"{r[c]:g}" for c in cols) + " |")
if "haproxy-x" in rows:
    base = rows["haproxy-x"]
    print()
    for t, r in rows.items():
        if t == "haproxy-x":
            continue
        parts = []
        for c in ("refused", "reset", "window_ms", "long_kept", "restart_ms"):
            if r[c] and base[c]:
                parts.append(f"{c} {r[c] / base[c]:.2f}x")
            else:
                parts.append(f"{c} {r[c]:g} vs {base[c]:g}")
        print(f"{t} / haproxy-x: " + ", ".join(parts))
if out:
    json.dump(rows, open(out, "w"), indent=1)
EOF
