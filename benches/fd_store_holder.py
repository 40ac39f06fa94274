#!/usr/bin/env python3
"""A stand-in for systemd's file descriptor store, for benches/restart.sh.

PID 1 of the bench host is not systemd, so `systemctl restart` cannot be
run there; this holder does for one daemon what systemd 252 does for a
unit with FileDescriptorStoreMax= (/work/shared/notes/systemd-fdstore.md):

  fd_store_holder.py --ready-file F [--max N] -- DAEMON ARGS...

* listens on a NOTIFY_SOCKET of its own and starts DAEMON with it;
* keeps every fd sent with FDSTORE=1 under its FDNAME (up to --max, the
  rest closed, as systemd does), closes the named ones on FDSTOREREMOVE=1;
* on SIGHUP restarts the daemon as `systemctl restart` does: SIGTERM, wait
  for the exit, then start the next one with the stored fds at 3.. and
  LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID (its own pid, through
  `sh -c 'LISTEN_PID=$$ exec "$@"'`), keeping the store across the gap;
* writes the daemon's pid to --ready-file each time it says READY=1;
* on SIGTERM stops the daemon, closes the store (as a stop does) and exits.

The bench's caller runs `harvester-lb prepare-stop --restart` before the
SIGHUP, as the unit's ExecStop= does before systemd's SIGTERM.
"""

import argparse
import array
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ready-file", required=True)
    p.add_argument("--max", type=int, default=4096)
    p.add_argument("--stop-timeout", type=float, default=60)
    p.add_argument("cmd", nargs="+")
    a = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="fd-store-")
    path = os.path.join(tmp, "notify")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(path)
    ns.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    ns.settimeout(0.1)
    store = {}  # name -> fd, in arrival order
    events = []

    signal.signal(signal.SIGHUP, lambda *_: events.append("restart"))
    signal.signal(signal.SIGTERM, lambda *_: events.append("stop"))

    def receive():
        try:
            msg, anc, _, _ = ns.recvmsg(65536, socket.CMSG_SPACE(253 * 4))
        except (socket.timeout, BlockingIOError, InterruptedError):
            return False
        fds = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(data[: len(data) - (len(data) % arr.itemsize)])
                fds.extend(arr)
        fields = dict(line.split("=", 1) for line in msg.decode(errors="replace").splitlines() if "=" in line)
        name = fields.get("FDNAME", "stored")
        if fields.get("FDSTORE") == "1":
            for fd in fds:
                if len(store) >= a.max:
                    print(f"fd-store: more than --max={a.max}, closing the rest", file=sys.stderr)
                    os.close(fd)
                    continue
                key = name
                n = 1
                while key in store:  # systemd keeps duplicates of a name
                    key = f"{name}\0{n}"
                    n += 1
                store[key] = fd
        else:
            for fd in fds:
                os.close(fd)
        if fields.get("FDSTOREREMOVE") == "1":
            for key in [k for k in store if k.split("\0")[0] == name]:
                os.close(store.pop(key))
        if fields.get("READY") == "1":
            with open(a.ready_file + ".tmp", "w") as fh:
                fh.write(str(child.pid))
            os.rename(a.ready_file + ".tmp", a.ready_file)
        return True

    def spawn():
        names = list(store)
        fds = [store[k] for k in names]
        env = dict(os.environ, NOTIFY_SOCKET=path)
        env.pop("LISTEN_FDS", None)
        env.pop("LISTEN_FDNAMES", None)
        if fds:
            env["LISTEN_FDS"] = str(len(fds))
            env["LISTEN_FDNAMES"] = ":".join(k.split("\0")[0] for k in names)

        def place():
            # The stored fds at 3, 4, ...: first out of the way, then in place.
            # Nothing else of the holder's (its other fds, the notify
            # socket) is left open in the daemon.
            high = [os.dup2(fd, 4000 + i) for i, fd in enumerate(fds)]
            for i, fd in enumerate(high):
                os.dup2(fd, 3 + i)
            os.closerange(3 + len(fds), 8192)

        args = ["sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh"] if fds else []
        return subprocess.Popen(args + a.cmd, env=env, preexec_fn=place, close_fds=False)

    child = spawn()
    while True:
        receive()
        if child.poll() is not None and "restart" not in events:
            print(f"fd-store: the daemon exited with {child.returncode}", file=sys.stderr)
            break
        if "stop" in events:
            child.terminate()
            child.wait(a.stop_timeout)
            break
        if "restart" in events:
            events.remove("restart")
            child.terminate()
            deadline = time.monotonic() + a.stop_timeout
            while child.poll() is None and time.monotonic() < deadline:
                receive()
            if child.poll() is None:
                child.kill()
                child.wait()
            while receive():  # what it sent before it exited
                pass
            child = spawn()
    for fd in store.values():
        os.close(fd)
    os.unlink(path)
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
