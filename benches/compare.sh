#!/usr/bin/env bash
# One command for the comparison of harvester-lb with HAProxy and nginx:
#   benches/compare.sh [--json FILE] [--rounds N] [--duration S] [--only LIST]
#                      [--scale-lbs N]          # scale scenario size (10000)
#   benches/compare.sh --smoke [--json FILE]   # CI: harvester-lb alone, ~1 min
# LIST: throughput,rps,cps,idle,health,reload,scale,udp (default: all).
# Installs what is missing from Debian packages, builds harvester-lb in
# release mode (cargo bench's profile) and runs benches/compare.rs.
# CARGO_TARGET_DIR is honoured; CARGO_PROFILE (default: bench) may be set to
# "dev" for a smoke run that reuses the debug build of `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

smoke=0
for a in "$@"; do [[ $a == --smoke ]] && smoke=1; done

need=()
command -v iperf3 >/dev/null || need+=(iperf3)
command -v wrk >/dev/null || need+=(wrk)
command -v tcpdump >/dev/null || need+=(tcpdump)
# The UDP scenario: dnsmasq is the DNS backend, dnsperf the load.
command -v dnsmasq >/dev/null || need+=(dnsmasq-base)
command -v dnsperf >/dev/null || need+=(dnsperf)
if ((smoke == 0)); then
  command -v haproxy >/dev/null || need+=(haproxy)
  command -v nginx >/dev/null || need+=(nginx)
  [[ -e /usr/lib/nginx/modules/ngx_stream_module.so ]] || need+=(libnginx-mod-stream)
fi
if ((${#need[@]})); then
  echo "installing: ${need[*]}" >&2
  sudo=""
  [[ $(id -u) == 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  # Do not let the nginx/haproxy packages start their system services.
  made_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
    $sudo chmod +x /usr/sbin/policy-rc.d
    made_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
  ((made_policy == 0)) || $sudo rm -f /usr/sbin/policy-rc.d
fi

profile=${CARGO_PROFILE:-bench}
exec cargo bench --profile "$profile" --bench compare -- "$@"
