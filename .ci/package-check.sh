#!/usr/bin/env bash
# Builds the host package (an RPM, with cargo-generate-rpm from the
# metadata in Cargo.toml) and checks it with rpm itself (Debian's `rpm`):
#
#   1. `rpm -qip`: name, version (Cargo.toml's), release, architecture,
#      license and summary;
#   2. `rpm -qlp`: exactly the expected files, with their modes and owner;
#      base.toml is the one %config(noreplace) file (the imported
#      config.toml is no package's: an upgrade never asks about it);
#   3. every file in the payload is byte for byte its source in the tree;
#   4. the package's drop-ins run the unit's own command lines, with
#      /usr/local/bin changed to /usr/bin and nothing else;
#   5. the units as installed (unit + package drop-in, binary at /usr/bin)
#      pass `systemd-analyze verify` silently, and the installed binary
#      accepts the installed example config (`harvester-lb check`) and
#      the shipped base.toml;
#   6. install, upgrade and removal with `rpm --root` into a scratch root:
#      an edited base.toml survives the upgrade untouched and is kept as
#      .rpmsave on removal, an imported config.toml is never touched and
#      gets no .rpmnew; the scriptlets parse (`sh -n`); an upgrade from
#      the old layout (config.toml the package's conffile, issue 43), its
#      scriptlets run in the scratch root with a stand-in systemctl, keeps
#      the imported config.toml in place and the daemon running;
#   7. the same package as a .deb (cargo-deb, `dpkg-deb -I/-c`): the same
#      files, base.toml the one conffile, the maintainer scripts in it;
#   8. (in 1 and 7) what the daemon runs is declared: Recommends nftables
#      and /etc/protocols (RPM), nftables and netbase (.deb).
#
# Usage: bash .ci/package-check.sh
# Env:   HARVESTER_LB_BIN  package this binary instead of `cargo build --release`
#        CARGO_TARGET_DIR  honoured when building
#        KEEP_RPM=DIR      copy the built RPM to DIR
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# The version CI installs; the metadata keys used in Cargo.toml are this
# version's (`cargo install` builds it once, ~/.cargo/bin keeps it).
generate_rpm_version=0.21.1
cargo_deb_version=3.8.0

fail() { echo "package-check: FAIL: $*" >&2; exit 1; }
step() { echo "== $*"; }

# --- tools ---------------------------------------------------------------------
if ! command -v rpm >/dev/null 2>&1; then
    step "rpm missing: installing Debian's rpm package"
    command -v apt-get >/dev/null 2>&1 || fail "rpm not found and no apt-get to install it"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends rpm >/dev/null
fi
if ! cargo generate-rpm --version >/dev/null 2>&1; then
    step "cargo install cargo-generate-rpm $generate_rpm_version"
    cargo install cargo-generate-rpm --locked --version "$generate_rpm_version" --quiet
fi
if ! cargo deb --version >/dev/null 2>&1; then
    step "cargo install cargo-deb $cargo_deb_version"
    cargo install cargo-deb --locked --version "$cargo_deb_version" --quiet
fi
echo "$(rpm --version), $(cargo generate-rpm --version), $(cargo deb --version)"

# --- the binary ------------------------------------------------------------------
target=${CARGO_TARGET_DIR:-$repo/target}
work=$(mktemp -d "${TMPDIR:-/tmp}/package-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [[ -n ${HARVESTER_LB_BIN:-} ]]; then
    # cargo-generate-rpm takes target/release/ from --target-dir.
    target=$work/target
    install -D -m 0755 "$HARVESTER_LB_BIN" "$target/release/harvester-lb"
else
    step "cargo build --release (no-op when up to date)"
    cargo build --release --locked --quiet --bin harvester-lb
fi
bin=$target/release/harvester-lb
[[ -x $bin ]] || fail "$bin is missing"

# --- build ---------------------------------------------------------------------------
step "cargo generate-rpm"
# xz: every rpm that SUSE has shipped reads it (zstd payloads need a newer
# rpm than some SLE releases have). File times from the last commit, so the
# same commit gives the same package.
source_date=$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)
mkdir -p "$work/out"
cargo generate-rpm --target-dir "$target" --payload-compress xz \
    --source-date "$source_date" -o "$work/out/" >/dev/null
rpms=("$work"/out/*.rpm)
((${#rpms[@]} == 1)) || fail "expected one RPM, got: ${rpms[*]}"
pkg=${rpms[0]}
echo "$(basename "$pkg"): $(stat -c %s "$pkg") bytes"
[[ -z ${KEEP_RPM:-} ]] || cp "$pkg" "$KEEP_RPM/"

status=0
bad() { echo "package-check: FAIL: $*" >&2; status=1; }

# --- 1. metadata -------------------------------------------------------------------
step "rpm -qip"
rpm -qip "$pkg" 2>/dev/null
version=$(sed -n -E '0,/^version = "(.*)"/s//\1/p' Cargo.toml)
arch=$(uname -m)
q() { rpm -qp --qf "$1" "$pkg" 2>/dev/null; }
[[ $(q '%{NAME}') == harvester-lb ]] || bad "Name is $(q '%{NAME}')"
[[ $(q '%{VERSION}') == "$version" ]] || bad "Version is $(q '%{VERSION}'), Cargo.toml says $version"
[[ $(q '%{RELEASE}') == 1 ]] || bad "Release is $(q '%{RELEASE}')"
[[ $(q '%{ARCH}') == "$arch" ]] || bad "Architecture is $(q '%{ARCH}'), this machine is $arch"
[[ $(q '%{LICENSE}') == Apache-2.0 ]] || bad "License is '$(q '%{LICENSE}')', want Apache-2.0"
[[ $(q '%{SUMMARY}') == *Harvester* ]] || bad "Summary is '$(q '%{SUMMARY}')'"
q '%{REQUIRENAME}\n' >/dev/null
rpm -qp --requires "$pkg" 2>/dev/null | grep -q '^libc.so.6' || bad "no automatic libc requirement (auto-req did not run)"
# What the daemon runs when configured to (nft; /etc/protocols, where nft
# resolves protocol names): weak dependencies, it starts without them.
rpm_recommends=$(rpm -qp --recommends "$pkg" 2>/dev/null)
for dep in nftables /etc/protocols; do
    grep -qx "$dep" <<<"$rpm_recommends" || bad "the RPM does not recommend $dep (Recommends: ${rpm_recommends//$'\n'/, })"
    rpm -qp --requires "$pkg" 2>/dev/null | grep -qx "$dep" && bad "the RPM requires $dep: it must be a Recommends (the daemon runs without it)"
done
echo "Recommends: ${rpm_recommends//$'\n'/, }"

# --- 2. files ----------------------------------------------------------------------
step "rpm -qlp"
# dest <- source, for every file the package must hold.
declare -A source_of=(
    [/usr/bin/harvester-lb]=$bin
    [/etc/harvester-lb/base.toml]=config/base.toml
    [/usr/share/harvester-lb/config.toml.example]=config/harvester-lb.toml
    [/usr/lib/systemd/system/harvester-lb.service]=systemd/harvester-lb.service
    [/usr/lib/systemd/system/harvester-lb.service.d/10-package.conf]=packaging/systemd/harvester-lb.service.d/10-package.conf
    [/usr/lib/systemd/system/harvester-lb-import.service]=systemd/harvester-lb-import.service
    [/usr/lib/systemd/system/harvester-lb-import.service.d/10-package.conf]=packaging/systemd/harvester-lb-import.service.d/10-package.conf
    [/usr/lib/systemd/system/harvester-lb-import.timer]=systemd/harvester-lb-import.timer
    [/usr/lib/systemd/system/harvester-lb-vrrp.path]=systemd/harvester-lb-vrrp.path
    [/usr/lib/systemd/system/harvester-lb-vrrp.service]=systemd/harvester-lb-vrrp.service
    [/usr/lib/systemd/system/harvester-lb-vrrp.service.d/10-package.conf]=packaging/systemd/harvester-lb-vrrp.service.d/10-package.conf
    [/usr/share/harvester-lb/prometheus/harvester-lb.rules.yml]=config/prometheus/harvester-lb.rules.yml
    [/usr/share/harvester-lb/grafana/harvester-lb.json]=config/grafana/harvester-lb.json
    [/usr/share/doc/harvester-lb/README.md]=README.md
    [/usr/share/licenses/harvester-lb/LICENSE]=LICENSE
)
# The opt-in drop-ins (extra privileges), shipped as examples, not enabled.
# The reference pages beside the README.
for page in docs/*.md; do
    [[ -f $page ]] || continue
    source_of[/usr/share/doc/harvester-lb/docs/$(basename "$page")]=$page
done
for dropin in systemd/harvester-lb.service.d/*.conf; do
    [[ -f $dropin ]] || continue
    source_of[/usr/share/harvester-lb/systemd/harvester-lb.service.d/$(basename "$dropin")]=$dropin
done
# Examples: the keepalived configuration for failover across hosts.
for example in config/keepalived/*; do
    [[ -f $example ]] || continue
    source_of[/usr/share/harvester-lb/keepalived/$(basename "$example")]=$example
done
# Examples: the BIRD configurations for anycast over BGP (docs/many-hosts.md).
for example in config/bird/*; do
    [[ -f $example ]] || continue
    source_of[/usr/share/harvester-lb/bird/$(basename "$example")]=$example
done
# Examples: the FRR configurations for anycast over BGP (docs/many-hosts.md).
for example in config/frr/*; do
    [[ -f $example ]] || continue
    source_of[/usr/share/harvester-lb/frr/$(basename "$example")]=$example
done
expected=$(printf '%s\n' "${!source_of[@]}" | sort)
listed=$(rpm -qlp "$pkg" 2>/dev/null | sort)
rpm -qlvp "$pkg" 2>/dev/null
if [[ $listed != "$expected" ]]; then
    diff <(echo "$expected") <(echo "$listed") || true
    bad "the package's files differ from the expected list (< expected, > packaged)"
fi
while read -r mode _ owner group _ _ _ _ path; do
    want=-rw-r--r--
    [[ $path == /usr/bin/* ]] && want=-rwxr-xr-x
    [[ $mode == "$want" && $owner == root && $group == root ]] || bad "$path is $mode $owner:$group, want $want root:root"
done < <(rpm -qlvp "$pkg" 2>/dev/null)
configs=$(rpm -qp --qf '[%{FILENAMES} %{FILEFLAGS:fflags}\n]' "$pkg" 2>/dev/null | awk '$2 ~ /c/')
[[ $configs == "/etc/harvester-lb/base.toml cn" ]] ||
    bad "the one config file must be /etc/harvester-lb/base.toml, %config(noreplace) (flags cn): config.toml is the import's; got: $configs"

# --- 3. payload = sources ------------------------------------------------------------
step "payload against the tree"
mkdir -p "$work/root"
rpm2archive - <"$pkg" | tar -xzf - -C "$work/root"
for dest in "${!source_of[@]}"; do
    cmp -s "$work/root$dest" "${source_of[$dest]}" || bad "$dest is not ${source_of[$dest]}"
done
echo "${#source_of[@]} files, each identical to its source"

# --- 4. the package's drop-ins run the unit's command lines -----------------------
step "drop-ins against the units"
for unit in harvester-lb.service harvester-lb-import.service harvester-lb-vrrp.service; do
    want=$(grep -E '^Exec[A-Za-z]+=' "systemd/$unit" | sed 's#/usr/local/bin/harvester-lb#/usr/bin/harvester-lb#g')
    got=$(grep -E '^Exec[A-Za-z]+=.' "packaging/systemd/$unit.d/10-package.conf")
    if [[ $want != "$got" ]]; then
        diff <(echo "$want") <(echo "$got") || true
        bad "packaging/systemd/$unit.d/10-package.conf does not match systemd/$unit's Exec lines (< unit with /usr/bin, > drop-in)"
    fi
    grep -v '^#' "packaging/systemd/$unit.d/10-package.conf" | grep -q '/usr/local/' && bad "$unit's package drop-in still names /usr/local"
done
echo "ok"

# --- 5. the units as installed -----------------------------------------------------
if command -v systemd-analyze >/dev/null 2>&1; then
    step "systemd-analyze verify, units as the package installs them"
    host_units=
    for d in /usr/lib/systemd/system /lib/systemd/system; do
        if [[ -f $d/multi-user.target ]]; then host_units=$d; break; fi
    done
    [[ -n $host_units ]] || fail "no system unit directory with multi-user.target on this host"
    # The host's units (network-online.target & co) beside the package's.
    cp -an "$host_units/." "$work/root/usr/lib/systemd/system/"
    install -D -m 0755 /bin/bash "$work/root/bin/bash"
    for unit in harvester-lb.service harvester-lb-import.service harvester-lb-import.timer harvester-lb-vrrp.path harvester-lb-vrrp.service; do
        out=$(systemd-analyze verify --root="$work/root" "$unit" 2>&1) || { echo "$out"; bad "verify $unit exited non-zero"; continue; }
        if [[ -n $out ]]; then
            echo "$out"
            bad "systemd-analyze verify $unit printed the above"
        else
            echo "$unit: clean"
        fi
    done
    # The drop-in is in force: the unit's ExecStart is /usr/bin's.
    exec_start=$(systemd-analyze cat-config --root="$work/root" systemd/system/harvester-lb.service 2>/dev/null |
        grep -E '^ExecStart=.' | tail -n1 || true)
    if [[ $exec_start != "ExecStart=/usr/bin/harvester-lb "* ]]; then
        bad "the last ExecStart= in force is '$exec_start', not /usr/bin/harvester-lb's"
    else
        echo "in force: $exec_start"
    fi
else
    echo "skipped systemd-analyze verify: systemd-analyze missing"
fi
step "the installed binary checks the installed example config and base.toml"
"$work/root/usr/bin/harvester-lb" check --config "$work/root/usr/share/harvester-lb/config.toml.example" ||
    bad "harvester-lb check rejects the packaged /usr/share/harvester-lb/config.toml.example"
# base.toml alone (no load balancer) is what the import puts above them.
"$work/root/usr/bin/harvester-lb" check --config "$work/root/etc/harvester-lb/base.toml" ||
    bad "harvester-lb check rejects the packaged /etc/harvester-lb/base.toml"

# --- 6. install, upgrade, remove ---------------------------------------------------------
step "rpm --root: install, edit base.toml, import a config.toml, upgrade, remove"
for s in pre_install post_install pre_uninstall post_uninstall post_trans; do
    sh -n "packaging/rpm/$s.sh" || bad "packaging/rpm/$s.sh does not parse"
done
rpm -qp --scripts "$pkg" 2>/dev/null | grep -q 'try-restart harvester-lb.service' || bad "the %postun scriptlet is not in the package"
[[ $(q '%{PREIN}') == *config.toml.rpm-upgrade* && $(q '%{POSTTRANS}') == *config.toml.rpm-upgrade* ]] ||
    bad "the %pre and %posttrans scriptlets (the old layout's upgrade) are not in the package"
# What the scriptlets ask systemd, run as the package holds them with
# systemd as PID 1 (/run/systemd/system swapped for a directory that
# exists) and a systemctl that only records. An upgrade must restart the
# daemon with one try-restart and never stop it: a stop (or stop + start)
# empties systemd's fd store, so the listeners and connections a restart
# hands over (issue 41) would be closed; a stop belongs to removal only.
# systemctl_calls TEXT ARGS...: the systemctl command lines, one a line.
systemctl_calls() {
    local text=$1 d=$work/scriptlet
    shift
    rm -rf "$d"
    mkdir -p "$d/bin" "$d/systemd-system"
    printf '#!/bin/sh\necho "$*" >>"%s/calls"\n' "$d" >"$d/bin/systemctl"
    chmod +x "$d/bin/systemctl"
    : >"$d/calls"
    printf '%s\n' "${text//\/run\/systemd\/system/$d/systemd-system}" >"$d/script"
    PATH=$d/bin:$PATH sh "$d/script" "$@" >/dev/null 2>&1 || echo "(exit $?)" >>"$d/calls"
    tr '\n' ';' <"$d/calls"
}
# expect_calls WHAT WANT TEXT ARGS...
expect_calls() {
    local what=$1 want=$2 got
    got=$(systemctl_calls "${@:3}")
    [[ $got == "$want" ]] || bad "$what asks systemctl '$got', want '$want'"
}
stop_calls='--no-reload disable --now harvester-lb-import.timer harvester-lb.service;'
expect_calls "%post on install" 'daemon-reload;' "$(q '%{POSTIN}')" 1
expect_calls "%post on upgrade" 'daemon-reload;' "$(q '%{POSTIN}')" 2
expect_calls "%preun on upgrade (must not stop)" '' "$(q '%{PREUN}')" 1
expect_calls "%preun on removal" "$stop_calls" "$(q '%{PREUN}')" 0
expect_calls "%postun on upgrade (try-restart only)" 'daemon-reload;try-restart harvester-lb.service;' "$(q '%{POSTUN}')" 1
expect_calls "%postun on removal" 'daemon-reload;' "$(q '%{POSTUN}')" 0
echo "scriptlets: upgrade = daemon-reload + try-restart, no stop; removal = disable --now"
# A second package, release 2 of the same version, to upgrade to.
cargo generate-rpm --target-dir "$target" --payload-compress xz --source-date "$source_date" \
    -s 'release = "2"' -o "$work/upgrade.rpm" >/dev/null
sys=$work/sysroot
mkdir -p "$sys"
rpmq() { rpm --root "$sys" --dbpath /var/lib/rpm "$@" 2>&1 | grep -v -e 'use Alien' -e 'know what you are doing' || true; }
# --nodeps: the scratch root has no libc package; --noscripts: no systemd in it.
rpmq --initdb
rpmq -i --nodeps --noscripts "$pkg"
[[ -x $sys/usr/bin/harvester-lb ]] || bad "install: no /usr/bin/harvester-lb"
[[ ! -e $sys/etc/harvester-lb/config.toml ]] || bad "install: the package put a config.toml (the import's file) in /etc/harvester-lb"
echo '# edited on this host' >>"$sys/etc/harvester-lb/base.toml"
edited=$(sha256sum <"$sys/etc/harvester-lb/base.toml")
# What the import timer writes: no package's file.
printf '# imported\n[admin]\n' >"$sys/etc/harvester-lb/config.toml"
imported=$(sha256sum <"$sys/etc/harvester-lb/config.toml")
rpmq -U --nodeps --noscripts "$work/upgrade.rpm"
[[ $(rpm --root "$sys" --dbpath /var/lib/rpm -q harvester-lb 2>/dev/null) == harvester-lb-$version-2.* ]] || bad "the upgrade did not install release 2"
[[ $(sha256sum <"$sys/etc/harvester-lb/base.toml") == "$edited" ]] || bad "the upgrade changed the edited base.toml"
[[ $(sha256sum <"$sys/etc/harvester-lb/config.toml") == "$imported" ]] || bad "the upgrade changed the imported config.toml"
leftover=$(find "$sys/etc/harvester-lb" -name '*.rpmnew' -o -name '*.rpmorig' -o -name '*.rpmsave')
[[ -z $leftover ]] || bad "the upgrade left $leftover"
echo "upgrade: the edited base.toml and the imported config.toml kept, no .rpmnew"
rpmq -e --nodeps --noscripts harvester-lb
[[ ! -e $sys/usr/bin/harvester-lb ]] || bad "remove: /usr/bin/harvester-lb is still there"
[[ -f $sys/etc/harvester-lb/base.toml.rpmsave ]] || bad "remove: the edited base.toml was not kept as base.toml.rpmsave"
[[ $(sha256sum <"$sys/etc/harvester-lb/config.toml") == "$imported" ]] || bad "remove: the imported config.toml was touched"
echo "remove: files gone, the edited base.toml kept as base.toml.rpmsave, the imported config.toml left as it was"

# --- 6b. upgrade from the old layout (issue 43) --------------------------------------
if [[ $(id -u) -ne 0 ]]; then
    # rpm runs scriptlets chrooted into --root: only root can.
    if [[ -n ${CI+set} ]]; then bad "the old layout's upgrade needs root (rpm chroots to run the scriptlets)"; fi
    echo "SKIPPED the old layout's upgrade: needs root (rpm chroots to run the scriptlets)"
else
    step "rpm --root: upgrade from the old layout (config.toml the package's conffile), scriptlets run"
    # The old package (before issue 43): /etc/harvester-lb/config.toml its
    # %config(noreplace) file, also the file the import timer rewrites; no
    # base.toml. Made from this tree as release 0 with the old file list (its
    # scriptlets are this tree's: the old ones differ in comments only, and an
    # old package's %pre and %posttrans do not run on an upgrade from it).
    old_assets='assets = [
      { source = "target/release/harvester-lb", dest = "/usr/bin/harvester-lb", mode = "755" },
      { source = "config/harvester-lb.toml", dest = "/etc/harvester-lb/config.toml", mode = "644", config = "noreplace" },
      { source = "systemd/harvester-lb.service", dest = "/usr/lib/systemd/system/harvester-lb.service", mode = "644" },
    ]'
    # No payload compression: the package is only installed here (xz of the
    # binary is most of a package's build time).
    cargo generate-rpm --target-dir "$target" --payload-compress none --source-date "$source_date" \
        -s 'release = "0"' -s "$old_assets" -o "$work/old.rpm" >/dev/null
    # A root where rpm runs the scriptlets (chrooted): sh and the tools they
    # call, /run/systemd/system (systemd as PID 1), and a systemctl that
    # records each call and plays the unit: active, and a start or restart
    # with no config.toml fails as the unit's ExecStartPre check does.
    old_root=$work/oldroot
    mkdir -p "$old_root/run/systemd/system" "$old_root/usr/bin" "$old_root/bin" "$old_root/dev"
    mknod -m 0666 "$old_root/dev/null" c 1 3
    for tool in sh cat ln mkdir rm mv; do
        path=$(command -v "$tool")
        install -D -m 0755 "$(readlink -f "$path")" "$old_root/bin/$tool"
        for lib in $(ldd "$path" | grep -oE '/[^ ]+'); do
            [[ -e $old_root$lib ]] || install -D -m 0755 "$lib" "$old_root$lib"
        done
    done
    cat >"$old_root/usr/bin/systemctl" <<'STUB'
#!/bin/sh
echo "$*" >>/systemctl.calls
case "$1" in
is-active) [ "$(cat /unit-state)" = active ]; exit ;;
start | restart | try-restart)
    [ "$1" = try-restart ] && [ "$(cat /unit-state)" != active ] && exit 0
    if [ -f /etc/harvester-lb/config.toml ]; then echo active >/unit-state; else echo failed >/unit-state; exit 1; fi ;;
esac
exit 0
STUB
    chmod 0755 "$old_root/usr/bin/systemctl"
    orpm() { rpm --root "$old_root" --dbpath /var/lib/rpm "$@" 2>&1 | grep -v -e 'use Alien' -e 'know what you are doing' || true; }
    orpm --initdb
    orpm -i --nodeps "$work/old.rpm"
    [[ -f $old_root/etc/harvester-lb/config.toml ]] || bad "old layout: the old package put no /etc/harvester-lb/config.toml"
    # The import rewrote it (the file the daemon serves), the daemon runs.
    { cat config/harvester-lb.toml; echo '# imported on this host'; } >"$old_root/etc/harvester-lb/config.toml"
    imported_old=$(sha256sum <"$old_root/etc/harvester-lb/config.toml")
    echo active >"$old_root/unit-state"
    : >"$old_root/systemctl.calls"
    upgrade_out=$(orpm -U --nodeps "$pkg")
    [[ -z $upgrade_out ]] || echo "$upgrade_out"
    calls=$(tr '\n' ';' <"$old_root/systemctl.calls")
    echo "systemctl during the upgrade: $calls"
    if [[ ! -f $old_root/etc/harvester-lb/config.toml ]]; then
        bad "old layout: after the upgrade /etc/harvester-lb/config.toml is gone ($(ls "$old_root/etc/harvester-lb" | tr '\n' ' ')): the daemon and the timer have no config"
    elif [[ $(sha256sum <"$old_root/etc/harvester-lb/config.toml") != "$imported_old" ]]; then
        bad "old layout: the upgrade changed the imported config.toml"
    else
        "$old_root/usr/bin/harvester-lb" check --config "$old_root/etc/harvester-lb/config.toml" >/dev/null ||
            bad "old layout: the kept config.toml does not pass check"
    fi
    [[ -f $old_root/etc/harvester-lb/base.toml ]] || bad "old layout: no base.toml after the upgrade"
    leftover=$(find "$old_root/etc/harvester-lb" "$old_root/var/lib/rpm-state" -name '*.rpm*' -o -name 'harvester-lb' -path '*rpm-state*' 2>/dev/null)
    [[ -z $leftover ]] || bad "old layout: the upgrade left $leftover"
    [[ $(cat "$old_root/unit-state") == active ]] ||
        bad "old layout: the daemon is $(cat "$old_root/unit-state") after the upgrade (systemctl: $calls), not serving"
    rpm --root "$old_root" --dbpath /var/lib/rpm -qal 2>/dev/null | grep -qx /etc/harvester-lb/config.toml &&
        bad "old layout: config.toml is still some package's file"
    echo "old layout: the imported config.toml kept in place (no package's now), no .rpmsave, the daemon running again"
fi

# --- 7. the .deb ---------------------------------------------------------------------------
step "cargo deb"
mkdir -p "$work/deb"
# cargo-deb takes target/release/ from CARGO_TARGET_DIR.
deb_log=$work/cargo-deb.log
SOURCE_DATE_EPOCH=$source_date CARGO_TARGET_DIR=$target cargo deb --no-build -o "$work/deb/" >"$deb_log" 2>&1 ||
    { cat "$deb_log"; fail "cargo deb failed"; }
debs=("$work"/deb/*.deb)
((${#debs[@]} == 1)) || fail "expected one .deb, got: ${debs[*]}"
deb=${debs[0]}
[[ -z ${KEEP_RPM:-} ]] || cp "$deb" "$KEEP_RPM/"
dpkg-deb -I "$deb"
field() { dpkg-deb -f "$deb" "$1"; }
[[ $(field Package) == harvester-lb ]] || bad "deb Package is $(field Package)"
[[ $(field Version) == "$version-1" ]] || bad "deb Version is $(field Version), want $version-1"
[[ $(field Architecture) == "$(dpkg --print-architecture)" ]] || bad "deb Architecture is $(field Architecture)"
[[ $(field Depends) == *libc6* ]] || bad "deb Depends is '$(field Depends)' (no automatic libc6)"
[[ $(field Recommends) == "nftables, netbase" ]] ||
    bad "deb Recommends is '$(field Recommends)', want 'nftables, netbase' (nft; /etc/protocols for nft)"
[[ $(field Depends) != *nftables* && $(field Depends) != *netbase* ]] ||
    bad "deb Depends is '$(field Depends)': nftables and netbase are Recommends (the daemon runs without them)"
# The RPM's files, and the copyright file Debian requires.
deb_files=$(dpkg-deb -c "$deb" | awk '$1 !~ /^d/ { sub(/^\./, "", $6); print $6 }' | sort)
# Debian keeps the license text in copyright, not under /usr/share/licenses.
deb_expected=$(printf '%s\n' "${!source_of[@]}" /usr/share/doc/harvester-lb/copyright |
    grep -v '^/usr/share/licenses/' | sort)
if [[ $deb_files != "$deb_expected" ]]; then
    diff <(echo "$deb_expected") <(echo "$deb_files") || true
    bad "the .deb's files differ from the RPM's (< expected, > packaged)"
fi
[[ $(dpkg-deb --info "$deb" conffiles) == /etc/harvester-lb/base.toml ]] ||
    bad "the .deb's conffiles are '$(dpkg-deb --info "$deb" conffiles)', want /etc/harvester-lb/base.toml (config.toml is the import's)"
mkdir -p "$work/debroot"
dpkg-deb -x "$deb" "$work/debroot"
for dest in "${!source_of[@]}"; do
    # cargo-deb strips the binary: that one must run, the rest be their sources.
    [[ $dest == /usr/bin/harvester-lb || $dest == /usr/share/licenses/* ]] && continue
    cmp -s "$work/debroot$dest" "${source_of[$dest]}" || bad "deb: $dest is not ${source_of[$dest]}"
done
"$work/debroot/usr/bin/harvester-lb" --version >/dev/null || bad "deb: the packaged binary does not run"
grep -q 'Apache License' "$work/debroot/usr/share/doc/harvester-lb/copyright" ||
    bad "deb: the copyright file does not carry the Apache-2.0 text"
grep -q '^License: Apache-2.0' "$work/debroot/usr/share/doc/harvester-lb/copyright" ||
    bad "deb: the copyright file names no Apache-2.0 license"
for s in postinst prerm postrm; do
    [[ $(dpkg-deb --info "$deb" "$s") == "$(cat "packaging/deb/$s")" ]] || bad "deb: $s is not packaging/deb/$s"
    sh -n "packaging/deb/$s" || bad "packaging/deb/$s does not parse"
done
# The same rule as the RPM's scriptlets (section 6): an upgrade is one
# try-restart, never a stop.
mscript() { dpkg-deb --info "$deb" "$1"; }
expect_calls "deb prerm upgrade (must not stop)" '' "$(mscript prerm)" upgrade "$version-2"
expect_calls "deb prerm remove" "$stop_calls" "$(mscript prerm)" remove
expect_calls "deb postinst configure (first install)" 'daemon-reload;' "$(mscript postinst)" configure ''
expect_calls "deb postinst configure (upgrade, try-restart only)" 'daemon-reload;try-restart harvester-lb.service;' "$(mscript postinst)" configure "$version-0"
expect_calls "deb postrm upgrade" '' "$(mscript postrm)" upgrade "$version-2"
expect_calls "deb postrm remove" 'daemon-reload;' "$(mscript postrm)" remove
echo "maintainer scripts: upgrade = daemon-reload + try-restart, no stop; removal = disable --now"
echo "$(basename "$deb"): $(stat -c %s "$deb") bytes, files, conffile and scripts as expected"

if ((status == 0)); then
    echo "package-check: OK ($(basename "$pkg"), $(basename "$deb"))"
fi
exit "$status"
