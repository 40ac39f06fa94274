# harvester-lb %pre ($1: 1 first install, 2 upgrade). An upgrade from the
# old layout (before issue 43: /etc/harvester-lb/config.toml was the
# package's %config(noreplace) file, and also the file the import timer
# rewrites): the new package owns no config.toml, so rpm removes the old
# one as it erases the old package (renamed to config.toml.rpmsave when it
# differs from the old example, deleted when not), and the old %postun's
# try-restart would start the daemon with no config. Keep a hard link to
# it (its content whatever rpm does with the name) and whether the daemon
# runs; %posttrans puts it back and starts the daemon again. Harmless on
# an upgrade from the new layout: %posttrans then just drops the link.
if [ "$1" -ge 2 ] && [ -f /etc/harvester-lb/config.toml ] && [ ! -L /etc/harvester-lb/config.toml ]; then
    ln -f /etc/harvester-lb/config.toml /etc/harvester-lb/config.toml.rpm-upgrade 2>/dev/null || :
    mkdir -p /var/lib/rpm-state/harvester-lb
    rm -f /var/lib/rpm-state/harvester-lb/was-active
    if [ -d /run/systemd/system ] && systemctl is-active --quiet harvester-lb.service 2>/dev/null; then
        : >/var/lib/rpm-state/harvester-lb/was-active
    fi
fi
