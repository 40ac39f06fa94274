# harvester-lb %post ($1: 1 first install, 2 upgrade). systemd learns of the
# units; nothing is enabled or started: the operator imports a config
# first, then enables harvester-lb.service (and the import timer).
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
