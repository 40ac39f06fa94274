#!/usr/bin/env bash
# Checks systemd/harvester-lb.service offline (no systemd as PID 1 needed):
#
#   1. `systemd-analyze verify` prints nothing (it exits 0 even when it warns,
#      so any output at all is a failure);
#   2. `systemd-analyze security --offline=true` scores <= 2.0;
#   3. every Exec*= command line of the unit is accepted by the binary built
#      from this tree (catches CLI drift: a renamed subcommand or flag);
#   4. when strace is available: the daemon is run on loopback (start, a
#      connection, SIGHUP reload, `harvester-lb reload`, SIGTERM drain, with a
#      NOTIFY_SOCKET and WATCHDOG_USEC set) and every system call it makes
#      must pass the unit's SystemCallFilter= (which fails blocked calls with
#      EPERM, silently, in production). SKIP_SYSCALL_TRACE=1 skips it.
#
# The unit is checked byte for byte as shipped: the release binary is staged
# at the unit's ExecStart= path inside a temporary --root, next to a copy of
# the host's unit directory (for network-online.target & co).
#
# Usage: bash .ci/systemd-check.sh
# Env:   HARVESTER_LB_BIN  use this binary instead of `cargo build --release`
#        CARGO_TARGET_DIR  honoured when building
#        MAX_EXPOSURE      default 2.0
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
unit_src=$repo/systemd/harvester-lb.service
unit=$(basename "$unit_src")
max_exposure=${MAX_EXPOSURE:-2.0}

fail() { echo "systemd-check: FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }

[[ -f $unit_src ]] || fail "$unit_src not found"

# --- systemd-analyze ---------------------------------------------------------
if ! command -v systemd-analyze >/dev/null 2>&1; then
    step "systemd-analyze missing: installing the systemd package"
    sudo=()
    [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    command -v apt-get >/dev/null 2>&1 || fail "systemd-analyze not found and no apt-get to install it"
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends systemd >/dev/null
    command -v systemd-analyze >/dev/null 2>&1 || fail "systemd-analyze still missing after installing systemd"
fi
echo "systemd-analyze: $(systemd-analyze --version | head -n1)"

# --- the binary ----------------------------------------------------------------
if [[ -n ${HARVESTER_LB_BIN:-} ]]; then
    bin=$HARVESTER_LB_BIN
else
    step "cargo build --release (no-op when up to date)"
    command -v cargo >/dev/null 2>&1 || fail "cargo not found; set HARVESTER_LB_BIN to a built harvester-lb"
    (cd "$repo" && cargo build --release --locked --quiet --bin harvester-lb)
    bin=${CARGO_TARGET_DIR:-$repo/target}/release/harvester-lb
fi
[[ -x $bin ]] || fail "binary $bin is missing or not executable"

# --- a throw-away root ---------------------------------------------------------
root=$(mktemp -d "${TMPDIR:-/tmp}/systemd-check.XXXXXX")
tracer=
backend=
cleanup() {
    # Only what this script started: the strace under test and its child,
    # and the backend.
    if [[ -n $tracer ]] && kill -0 "$tracer" 2>/dev/null; then
        kill $(pgrep -P "$tracer") "$tracer" 2>/dev/null || true
    fi
    if [[ -n $backend ]]; then kill "$backend" 2>/dev/null || true; fi
    rm -rf "$root"
}
trap cleanup EXIT

host_units=
for d in /usr/lib/systemd/system /lib/systemd/system; do
    if [[ -f $d/multi-user.target ]]; then host_units=$d; break; fi
done
[[ -n $host_units ]] || fail "no system unit directory with multi-user.target on this host"
mkdir -p "$root/usr/lib/systemd" "$root/etc/systemd/system"
cp -a "$host_units" "$root/usr/lib/systemd/system"
cp "$unit_src" "$root/etc/systemd/system/$unit"

# Every absolute program path of an Exec*= line (prefixes like -@:+! dropped)
# gets the built binary.
mapfile -t exec_lines < <(sed -n -E 's/^[[:space:]]*(Exec[A-Za-z]+)=[-@:+!]*(.*)$/\1 \2/p' "$unit_src")
((${#exec_lines[@]} > 0)) || fail "$unit has no Exec*= line"
exec_path=$(sed -n -E 's/^[[:space:]]*ExecStart=[-@:+!]*([^[:space:]]+).*/\1/p' "$unit_src" | head -n1)
[[ $exec_path == /* ]] || fail "ExecStart= must name an absolute path, got '$exec_path'"
install -D -m 0755 "$bin" "$root$exec_path"

status=0

# --- 1. verify -------------------------------------------------------------------
step "systemd-analyze verify $unit"
verify_out=$(systemd-analyze verify --root="$root" "$unit" 2>&1) || {
    echo "$verify_out"
    fail "systemd-analyze verify exited non-zero"
}
if [[ -n $verify_out ]]; then
    echo "$verify_out"
    echo "systemd-check: FAIL: systemd-analyze verify printed the above (it must print nothing)" >&2
    status=1
else
    echo "clean"
fi

# --- 2. security -------------------------------------------------------------------
step "systemd-analyze security --offline=true $unit"
# --threshold would make it exit 1 above the bar; we compare ourselves for a
# clearer message, and show the whole table either way.
sec_out=$(systemd-analyze security --offline=true --no-pager --root="$root" "$unit" 2>&1) || true
echo "$sec_out"
score_line=$(grep -E 'Overall exposure level for ' <<<"$sec_out" | tail -n1 || true)
score=$(sed -n -E 's/.*: ([0-9]+(\.[0-9]+)?) .*/\1/p' <<<"$score_line")
[[ -n $score ]] || fail "could not read the exposure score from systemd-analyze security"
if awk -v s="$score" -v m="$max_exposure" 'BEGIN { exit !(s > m) }'; then
    echo "systemd-check: FAIL: exposure $score is above $max_exposure: tighten the unit (see the ✗ lines above)" >&2
    status=1
else
    echo "exposure $score <= $max_exposure"
fi

# The root half of [keepalived]/[conntrackd] under the unit, which
# vrrp.conf (below) wants: present for every verify from here on.
for extra in harvester-lb-vrrp.path harvester-lb-vrrp.service; do
    [[ -f $repo/systemd/$extra ]] || fail "systemd/$extra not found"
    cp "$repo/systemd/$extra" "$root/etc/systemd/system/$extra"
done

# --- 2b. opt-in drop-ins -------------------------------------------------------------
# Each drop-in in systemd/harvester-lb.service.d/ (privileges the VIP
# features need) is verified and scored together with the unit, then
# removed again so the steps below see the unit as shipped.
max_dropin_exposure=${MAX_DROPIN_EXPOSURE:-3.0}
for dropin in "$repo"/systemd/harvester-lb.service.d/*.conf; do
    [[ -f $dropin ]] || continue
    name=$(basename "$dropin")
    step "drop-in $name: verify and security"
    mkdir -p "$root/etc/systemd/system/$unit.d"
    cp "$dropin" "$root/etc/systemd/system/$unit.d/$name"
    out=$(systemd-analyze verify --root="$root" "$unit" 2>&1) || { echo "$out"; fail "verify with $name exited non-zero"; }
    if [[ -n $out ]]; then
        echo "$out"
        echo "systemd-check: FAIL: verify with $name printed the above" >&2
        status=1
    fi
    sec=$(systemd-analyze security --offline=true --no-pager --root="$root" "$unit" 2>&1) || true
    dscore=$(grep -E 'Overall exposure level for ' <<<"$sec" | tail -n1 | sed -n -E 's/.*: ([0-9]+(\.[0-9]+)?) .*/\1/p')
    [[ -n $dscore ]] || fail "could not read the exposure score with $name"
    if awk -v s="$dscore" -v m="$max_dropin_exposure" 'BEGIN { exit !(s > m) }'; then
        grep -E '✗' <<<"$sec" || true
        echo "systemd-check: FAIL: exposure with $name is $dscore, above $max_dropin_exposure" >&2
        status=1
    else
        echo "exposure with $name: $dscore <= $max_dropin_exposure (unit alone: $score)"
    fi
    rm -rf "$root/etc/systemd/system/$unit.d"
done

# --- 3. the binary accepts the unit's command lines ------------------------------
step "Exec*= command lines against $bin"
for line in "${exec_lines[@]}"; do
    key=${line%% *}
    read -r -a argv <<<"${line#* }"
    [[ ${argv[0]} == "$exec_path" ]] || { echo "$key: ${argv[0]} is not the daemon binary, skipped"; continue; }
    # clap parses every argument before honouring --help: an unknown
    # subcommand or flag fails here.
    if out=$("$bin" "${argv[@]:1}" --help 2>&1); then
        echo "$key: ok (${argv[*]:1})"
    else
        echo "$out" | head -n 20
        echo "systemd-check: FAIL: $key=${argv[*]} is not accepted by the binary" >&2
        status=1
    fi
done

# --- 3b. the import service and timer ---------------------------------------------
# The oneshot import (kubectl | harvester-lb import --write) and its timer:
# verify must be silent, and the harvester-lb command line inside the
# shell pipeline must be accepted by the binary.
for extra in harvester-lb-import.service harvester-lb-import.timer; do
    [[ -f $repo/systemd/$extra ]] || fail "systemd/$extra not found"
    cp "$repo/systemd/$extra" "$root/etc/systemd/system/$extra"
done
shell=$(sed -n -E 's/^ExecStart=([^[:space:]]+).*/\1/p' "$repo/systemd/harvester-lb-import.service")
[[ $shell == /* && -x $shell ]] || fail "harvester-lb-import.service: ExecStart= $shell is not an executable on this host"
install -D -m 0755 "$shell" "$root$shell"
# `systemd-analyze verify` of one more unit in the root: must print nothing.
verify_extra() {
    local out
    step "systemd-analyze verify $1"
    out=$(systemd-analyze verify --root="$root" "$1" 2>&1) || { echo "$out"; fail "systemd-analyze verify $1 exited non-zero"; }
    if [[ -n $out ]]; then
        echo "$out"
        echo "systemd-check: FAIL: systemd-analyze verify $1 printed the above (it must print nothing)" >&2
        status=1
    else
        echo "clean"
    fi
}
for extra in harvester-lb-import.service harvester-lb-import.timer; do
    verify_extra "$extra"
done
import_cmd=$(grep -oE "$exec_path import [^'|]*" "$repo/systemd/harvester-lb-import.service" | head -n1)
[[ -n $import_cmd ]] || fail "harvester-lb-import.service does not run '$exec_path import'"
read -r -a argv <<<"$import_cmd"
if out=$("$bin" "${argv[@]:1}" --help 2>&1); then
    echo "harvester-lb-import.service: ok (${argv[*]:1})"
else
    echo "$out" | head -n 20
    echo "systemd-check: FAIL: harvester-lb-import.service's '${argv[*]}' is not accepted by the binary" >&2
    status=1
fi
timer_unit=$(sed -n -E 's/^Unit=(.*)/\1/p' "$repo/systemd/harvester-lb-import.timer")
[[ -z $timer_unit || $timer_unit == harvester-lb-import.service ]] || fail "harvester-lb-import.timer starts $timer_unit"

# --- 3c. the vrrp path and service (root's half of vrrp.conf) ------------------------
for extra in harvester-lb-vrrp.path harvester-lb-vrrp.service; do
    verify_extra "$extra"
done
[[ $(sed -n -E 's/^Unit=(.*)/\1/p' "$repo/systemd/harvester-lb-vrrp.path") == harvester-lb-vrrp.service ]] ||
    fail "harvester-lb-vrrp.path does not start harvester-lb-vrrp.service"
vrrp_cmd=$(sed -n -E 's/^ExecStart=(.*)/\1/p' "$repo/systemd/harvester-lb-vrrp.service")
read -r -a argv <<<"$vrrp_cmd"
[[ ${argv[0]} == "$exec_path" ]] || fail "harvester-lb-vrrp.service runs ${argv[0]}, not $exec_path"
if out=$("$bin" "${argv[@]:1}" --help 2>&1); then
    echo "harvester-lb-vrrp.service: ok (${argv[*]:1})"
else
    echo "$out" | head -n 20
    echo "systemd-check: FAIL: harvester-lb-vrrp.service's '${argv[*]}' is not accepted by the binary" >&2
    status=1
fi
# The hand-off directory is the same in the drop-in, the path unit and
# the service.
handoff=$(sed -n -E 's/^Environment=HARVESTER_LB_VRRP_HANDOFF=(.*)/\1/p' "$repo/systemd/harvester-lb.service.d/vrrp.conf")
[[ -n $handoff ]] || fail "vrrp.conf sets no HARVESTER_LB_VRRP_HANDOFF"
grep -qx "PathChanged=$handoff" "$repo/systemd/harvester-lb-vrrp.path" || fail "harvester-lb-vrrp.path does not watch $handoff"
[[ $vrrp_cmd == *"--from $handoff"* ]] || fail "harvester-lb-vrrp.service does not read $handoff"

# --- 4. the syscall filter lets the daemon do its job ---------------------------
# Expands @groups recursively as this systemd version defines them.
expand_group() {
    local x
    systemd-analyze syscall-filter "$1" 2>/dev/null | sed -n '2,$p' | sed -E 's/^[[:space:]]+//; /^#/d; /^$/d' |
        while read -r x; do
            if [[ $x == @* ]]; then expand_group "$x"; else echo "$x"; fi
        done
}
step "system calls of a short loopback run against SystemCallFilter="
if [[ ${SKIP_SYSCALL_TRACE:-} == 1 ]]; then
    echo "skipped (SKIP_SYSCALL_TRACE=1)"
elif ! command -v strace >/dev/null 2>&1 || ! strace -qq -o /dev/null true 2>/dev/null; then
    echo "skipped: strace missing or ptrace not permitted"
else
    work=$root/trace
    mkdir -p "$work"
    # Allowed = the first (allow) SystemCallFilter= line minus every ~ line.
    mapfile -t filters < <(sed -n -E 's/^[[:space:]]*SystemCallFilter=(.*)$/\1/p' "$unit_src")
    ((${#filters[@]} > 0)) || fail "$unit has no SystemCallFilter="
    [[ ${filters[0]} != "~"* ]] || fail "the first SystemCallFilter= of $unit must be an allow list"
    for f in "${filters[@]}"; do
        for item in ${f#\~}; do
            if [[ $item == @* ]]; then expand_group "$item"; else echo "$item"; fi
        done >>"$work/$([[ $f == "~"* ]] && echo deny || echo allow).txt"
    done
    touch "$work/deny.txt"
    comm -23 <(sort -u "$work/allow.txt") <(sort -u "$work/deny.txt") >"$work/allowed.txt"

    port=$((20000 + RANDOM % 10000))
    admin_port=$((port + 1))
    backend_port=$((port + 2))
    # A real backend on another loopback address (the daemon refuses a
    # backend that reaches its own admin API): Python's HTTP server.
    python3 -m http.server --bind 127.0.0.2 "$backend_port" --directory "$work" >"$work/backend.log" 2>&1 &
    backend=$!
    cat >"$work/config.toml" <<TOML
[admin]
listen = "127.0.0.1:$admin_port"
socket = "$work/admin.sock"
[proxy]
drain_timeout_seconds = 1
[[load_balancer]]
name = "ci/systemd-check"
cluster = "ci"
vip = "127.0.0.1"
backends = ["127.0.0.2"]
  [[load_balancer.listener]]
  name = "tcp"
  port = $port
  backend_port = $backend_port
TOML
    "$bin" check --config "$work/config.toml" >/dev/null
    # The backend answers on 127.0.0.2; the forwarded connection gets a reply.
    NOTIFY_SOCKET=$work/notify.sock WATCHDOG_USEC=1000000 \
        strace -f -qq -o "$work/run.trace" "$bin" run --config "$work/config.toml" 2>"$work/run.log" &
    tracer=$!
    # Ready = the VIP listener accepts, the daemon logged that it runs, and
    # its SIGTERM handler is installed (that comes last: a signal sent
    # earlier would kill it with the default action).
    daemon=
    for _ in $(seq 100); do
        daemon=$(pgrep -P "$tracer" -x harvester-lb || true)
        if [[ -n $daemon ]] && grep -q 'harvester-lb running' "$work/run.log" &&
            grep -q 'rt_sigaction(SIGTERM, {sa_handler=0x' "$work/run.trace" &&
            (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            break
        fi
        daemon=
        sleep 0.1
    done
    [[ -n $daemon ]] || { cat "$work/run.log"; fail "the daemon did not start under strace (VIP port $port taken?)"; }
    # One forwarded connection to the backend, so connect and splice(2)
    # are exercised.
    for _ in $(seq 50); do
        (exec 4<>"/dev/tcp/127.0.0.2/$backend_port") 2>/dev/null && break
        sleep 0.1
    done
    exec 3<>"/dev/tcp/127.0.0.1/$port"
    printf 'GET / HTTP/1.0\r\n\r\n' >&3
    timeout 5 cat <&3 >/dev/null || true
    exec 3>&-
    # Through the admin socket (bind, chmod and rename of the socket at start
    # are in run.trace): a reload, and a backend state change there and back.
    strace -f -qq -o "$work/reload.trace" "$bin" reload --config "$work/config.toml" >/dev/null || true
    strace -f -qq -o "$work/backend.trace" "$bin" backend drain --lb ci/systemd-check 127.0.0.2 --config "$work/config.toml" >/dev/null ||
        { cat "$work/run.log"; fail "harvester-lb backend drain failed against the admin socket"; }
    "$bin" backend ready --lb ci/systemd-check 127.0.0.2 --config "$work/config.toml" >/dev/null
    kill -HUP "$daemon"
    sleep 1.2
    kill -TERM "$daemon"
    wait "$tracer" || { cat "$work/run.log"; fail "the daemon did not exit 0 on SIGTERM"; }
    tracer=
    cat "$work/run.trace" "$work/reload.trace" "$work/backend.trace" | grep -oE '^[0-9]+ +[a-z_0-9]+\(' |
        sed -E 's/^[0-9]+ +//; s/\($//' | sort -u >"$work/used.txt"
    blocked=$(comm -23 "$work/used.txt" "$work/allowed.txt")
    if [[ -n $blocked ]]; then
        echo "used but not allowed by SystemCallFilter=: $(echo $blocked)"
        echo "systemd-check: FAIL: the unit's SystemCallFilter= would fail these calls with EPERM" >&2
        status=1
    else
        echo "$(wc -l <"$work/used.txt") distinct system calls used, all allowed"
    fi
fi

if ((status == 0)); then
    echo "systemd-check: OK ($unit: verify clean, exposure $score)"
fi
exit "$status"
