# harvester-lb %postun ($1: 0 removal, 1 upgrade). After an upgrade a
# running daemon is restarted on the new binary (SIGTERM drains, as any
# stop); a stopped one stays stopped. /etc/harvester-lb/base.toml is
# %config(noreplace): an edited one is kept as it is; the imported
# /etc/harvester-lb/config.toml belongs to no package and is never touched.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -ge 1 ]; then
        systemctl try-restart harvester-lb.service >/dev/null 2>&1 || :
    fi
fi
