#!/usr/bin/env bash
# One command for the comparison of harvester-lb with HAProxy, nginx and the
# kernel's own forwarding (nftables DNAT, as kube-proxy forwards a Service):
#   benches/compare.sh [--json FILE] [--rounds N] [--duration S] [--only LIST]
#                      [--threads T1,T2]        # traffic scenarios' threads (1,2)
#                      [--scale-lbs N]          # scale scenario size (10000)
#                      [--scale-kernel-lbs N]   # scale-kernel scenario size (10000)
#                      [--log-modes]   # + harvester-lb with log_connections
#                                      # "errors" and "all", ratios to "none"
#   benches/compare.sh --smoke [--json FILE]   # CI: harvester-lb (1 and 2 threads),
#                                              # harvester-lb (kernel) and the
#                                              # kernel target, ~1.5 min
#   benches/compare.sh --only forward [--conntrack on,off]
#                      [--forward-targets direct,kernel,hlb-kernel,hlb,haproxy]
#                      # the forward path: client, LB host (routing) and
#                      # backend in three network namespaces, the kernel
#                      # targets through prerouting and forward; direct,
#                      # kernel, harvester-lb (kernel), harvester-lb and
#                      # HAProxy with conntrack on and off (root)
# LIST: throughput,rps,cps,idle,health,reload,scale,scale-kernel,udp,forward
# (default: all but forward).
# HLB_ARGS="..." is appended to every `harvester-lb run` (e.g. to A/B a
# runtime option). The kernel targets (the kernel's own DNAT and
# harvester-lb with forwarding = "kernel") need root and nft; without them
# they are left out with a note. As root the bench runs in an unnamed network
# namespace of its own (their VIPs on its lo), so their nftables tables and
# conntrack's TIME_WAIT timeout are that namespace's and go with it; nothing
# of the host's is changed.
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
# The kernel target's DNAT; only root may use it.
if [[ $(id -u) == 0 ]]; then
  command -v nft >/dev/null || need+=(nftables)
fi
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
