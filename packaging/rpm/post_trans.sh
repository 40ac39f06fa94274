# harvester-lb %posttrans: runs once the whole transaction is done, after
# the old package's files are gone and its %postun ran. See %pre: on an
# upgrade from the old layout, /etc/harvester-lb/config.toml (the import's
# file) is put back where the daemon and the import timer read it, from
# config.toml.rpmsave when rpm made one in this transaction (the newest
# content), else from the link %pre kept; then a daemon that ran before
# the upgrade is started again (the old %postun's restart found no config).
d=/etc/harvester-lb
state=/var/lib/rpm-state/harvester-lb
if [ -f "$d/config.toml.rpm-upgrade" ]; then
    if [ ! -e "$d/config.toml" ]; then
        if [ -f "$d/config.toml.rpmsave" ] && { [ "$d/config.toml.rpmsave" -ef "$d/config.toml.rpm-upgrade" ] || [ "$d/config.toml.rpmsave" -nt "$d/config.toml.rpm-upgrade" ]; }; then
            mv -f "$d/config.toml.rpmsave" "$d/config.toml"
        else
            mv -f "$d/config.toml.rpm-upgrade" "$d/config.toml"
        fi
        echo "harvester-lb: /etc/harvester-lb/config.toml kept (the import's file; the package no longer owns it, the settings of this host go to /etc/harvester-lb/base.toml)"
        if [ -f "$state/was-active" ] && [ -d /run/systemd/system ]; then
            systemctl reset-failed harvester-lb.service >/dev/null 2>&1 || :
            systemctl is-active --quiet harvester-lb.service 2>/dev/null ||
                systemctl start harvester-lb.service >/dev/null 2>&1 || :
        fi
    fi
    rm -f "$d/config.toml.rpm-upgrade"
fi
rm -rf "$state"
