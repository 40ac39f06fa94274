# harvester-lb %preun ($1: 0 removal, 1 upgrade). On removal only: stop and
# disable the timer and the daemon (the daemon drains its connections).
if [ "$1" -eq 0 ] && [ -d /run/systemd/system ]; then
    systemctl --no-reload disable --now harvester-lb-import.timer harvester-lb.service >/dev/null 2>&1 || :
fi
