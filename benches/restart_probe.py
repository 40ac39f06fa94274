#!/usr/bin/env python3
"""What a restart costs, as clients see it (issue 41).

Two modes, standard library only (it runs in the minimal Debian root of
.ci/systemd-boot.sh as well as on the bench host):

  restart_probe.py serve --tcp IP:PORT [--udp IP:PORT] [--tag NAME]
      A line-echo backend: every line a TCP client sends is answered with
      "<line> <tag>"; every UDP datagram likewise.

  restart_probe.py run --tcp VIP:PORT [--udp VIP:PORT] [--long 10]
                       [--line-ms 100] [--new-ms 50] [--before 2] [--after 3]
                       [--json FILE] -- ACTION ...
      Opens --long connections that each exchange a line every --line-ms,
      starts a new connection (connect, one line, its answer, close) every
      --new-ms and, with --udp, sends a datagram of one flow (one source
      port) every --new-ms; after --before seconds runs ACTION (a restart:
      `systemctl restart harvester-lb`, `dpkg -i`, a script), waits until
      --after seconds past its end, stops and prints the figures:

        new connections: ok, refused (ECONNREFUSED), reset (ECONNRESET or
          EOF before the answer), timeout (no answer in 3 s), other
        window_ms: from the start of the first failed new connection to the
          end of the last (0: none failed); slowest_ok_ms: the slowest
          connection that was answered (one that waited in an accept queue)
        long connections kept: answered every line, before, during and
          after ACTION, on the same socket; the others with how they ended
        udp: datagrams sent, answered, lost (no answer in 1 s), and the
          backend tags that answered the one flow

Every wait is bounded; every connection has a timeout. Only the addresses
given are contacted (the callers pass loopback or addresses inside their
own namespaces).
"""

import argparse
import errno
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time

ANSWER_TIMEOUT = 3.0
UDP_TIMEOUT = 1.0


def addr(s):
    host, _, port = s.rpartition(":")
    return host.strip("[]"), int(port)


# --- serve --------------------------------------------------------------------------------


def serve(a):
    tag = a.tag or f"pid{os.getpid()}"

    class Echo(socketserver.StreamRequestHandler):
        def handle(self):
            try:
                for line in self.rfile:
                    self.wfile.write(line.rstrip(b"\n") + b" " + tag.encode() + b"\n")
                    self.wfile.flush()
            except OSError:
                pass

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True
        request_queue_size = 1024

    tcp = Server(addr(a.tcp), Echo)
    threading.Thread(target=tcp.serve_forever, daemon=True).start()
    if a.udp:
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(addr(a.udp))

        def udp_loop():
            while True:
                data, peer = u.recvfrom(65535)
                u.sendto(data + b" " + tag.encode(), peer)

        threading.Thread(target=udp_loop, daemon=True).start()
    print(f"serving tcp {a.tcp} udp {a.udp or '-'} as {tag}", flush=True)
    while True:
        time.sleep(3600)


# --- run ----------------------------------------------------------------------------------


def classify(e):
    if isinstance(e, socket.timeout):
        return "timeout"
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, (ConnectionResetError, BrokenPipeError, EOFError)):
        return "reset"
    if isinstance(e, OSError) and e.errno in (errno.ECONNRESET, errno.EPIPE):
        return "reset"
    if isinstance(e, OSError) and e.errno == errno.ECONNREFUSED:
        return "refused"
    return "other"


def read_line(sock, buf):
    """One line from sock (buf: bytes already read); EOFError on EOF."""
    while b"\n" not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            raise EOFError("closed before the answer")
        buf += chunk
    line, _, rest = buf.partition(b"\n")
    return line, rest


class Run:
    def __init__(self, a):
        self.a = a
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.new = []  # (start, end, outcome, detail)
        self.long = {}  # i -> {"lines": n, "end": None | (t, kind, detail)}
        self.udp_sent = {}
        self.udp_answered = {}
        self.udp_tags = {}

    def now(self):
        return time.monotonic() - self.t0

    # One new connection: connect, a line, its answer, close.
    def one_new(self, n):
        start = self.now()
        outcome, detail = "ok", ""
        try:
            with socket.create_connection(addr(self.a.tcp), timeout=ANSWER_TIMEOUT) as s:
                s.settimeout(ANSWER_TIMEOUT)
                s.sendall(b"new %d\n" % n)
                line, _ = read_line(s, b"")
                if not line.startswith(b"new %d " % n):
                    outcome, detail = "other", f"answer {line[:60]!r}"
        except Exception as e:  # noqa: BLE001 - every failure is a figure
            outcome, detail = classify(e), f"{type(e).__name__}: {e}"
        with self.lock:
            self.new.append((start, self.now(), outcome, detail))

    def new_loop(self):
        n = 0
        threads = []
        next_t = time.monotonic()
        while not self.stop.is_set():
            t = threading.Thread(target=self.one_new, args=(n,), daemon=True)
            t.start()
            threads.append(t)
            n += 1
            next_t += self.a.new_ms / 1000
            delay = next_t - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
        for t in threads:
            t.join(ANSWER_TIMEOUT * 3)

    def long_conn(self, i, ready):
        rec = {"lines": 0, "end": None}
        self.long[i] = rec
        try:
            s = socket.create_connection(addr(self.a.tcp), timeout=ANSWER_TIMEOUT)
        except Exception as e:  # noqa: BLE001
            rec["end"] = (self.now(), "connect-" + classify(e), str(e))
            ready.release()
            return
        s.settimeout(ANSWER_TIMEOUT)
        buf = b""
        first = True
        with s:
            while not self.stop.is_set():
                try:
                    s.sendall(b"long %d %d\n" % (i, rec["lines"]))
                    line, buf = read_line(s, buf)
                    if not line.startswith(b"long %d %d " % (i, rec["lines"])):
                        rec["end"] = (self.now(), "other", f"answer {line[:60]!r}")
                        break
                    rec["lines"] += 1
                except Exception as e:  # noqa: BLE001
                    rec["end"] = (self.now(), classify(e), f"{type(e).__name__}: {e}")
                    break
                finally:
                    if first:
                        first = False
                        ready.release()
                self.stop.wait(self.a.line_ms / 1000)

    def udp_loop(self):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.connect(addr(self.a.udp))
        u.settimeout(0.2)

        def rx():
            while not self.stop.is_set() or self.now() < self.udp_until:
                try:
                    data = u.recv(65535)
                except socket.timeout:
                    continue
                except OSError:
                    # ECONNREFUSED from an ICMP port unreachable: counted as lost.
                    continue
                parts = data.split(b" ")
                if len(parts) >= 3 and parts[0] == b"udp":
                    seq = int(parts[1])
                    with self.lock:
                        self.udp_answered.setdefault(seq, self.now())
                        tag = parts[2].decode(errors="replace")
                        self.udp_tags[tag] = self.udp_tags.get(tag, 0) + 1

        self.udp_until = float("inf")
        r = threading.Thread(target=rx, daemon=True)
        r.start()
        seq = 0
        next_t = time.monotonic()
        while not self.stop.is_set():
            try:
                u.send(b"udp %d" % seq)
            except OSError:
                pass
            with self.lock:
                self.udp_sent[seq] = self.now()
            seq += 1
            next_t += self.a.new_ms / 1000
            delay = next_t - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
        self.udp_until = self.now() + UDP_TIMEOUT
        r.join(UDP_TIMEOUT + 1)

    def go(self, action):
        a = self.a
        ready = threading.Semaphore(0)
        threads = [threading.Thread(target=self.long_conn, args=(i, ready), daemon=True) for i in range(a.long)]
        for t in threads:
            t.start()
        for _ in range(a.long):
            ready.acquire(timeout=10)
        opened = sum(1 for r in self.long.values() if r["end"] is None)
        threads.append(threading.Thread(target=self.new_loop, daemon=True))
        if a.udp:
            threads.append(threading.Thread(target=self.udp_loop, daemon=True))
        for t in threads[a.long :]:
            t.start()
        time.sleep(a.before)
        act_start = self.now()
        proc = subprocess.run(action, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=a.action_timeout)
        act_end = self.now()
        time.sleep(a.after)
        self.stop.set()
        for t in threads:
            t.join(ANSWER_TIMEOUT * 4)
        return self.figures(opened, act_start, act_end, proc)

    def figures(self, opened, act_start, act_end, proc):
        with self.lock:
            new = list(self.new)
        counts = {k: 0 for k in ("ok", "refused", "reset", "timeout", "other")}
        for _, _, outcome, _ in new:
            counts[outcome] += 1
        failed = [x for x in new if x[2] != "ok"]
        window_ms = 0
        first_fail = None
        if failed:
            first_fail = min(x[0] for x in failed)
            window_ms = round((max(x[1] for x in failed) - first_fail) * 1000)
        ok_lat = [x[1] - x[0] for x in new if x[2] == "ok"]
        kept = sum(1 for r in self.long.values() if r["end"] is None and r["lines"] > 0)
        lost = {}
        for i, r in sorted(self.long.items()):
            if r["end"] is not None:
                lost[str(i)] = {
                    "at_ms": round((r["end"][0] - act_start) * 1000),
                    "how": r["end"][1],
                    "detail": r["end"][2][:120],
                    "lines_before": r["lines"],
                }
        out = {
            "action": " ".join(self.a.action),
            "action_rc": proc.returncode,
            "action_ms": round((act_end - act_start) * 1000),
            "action_output_tail": proc.stdout.decode(errors="replace")[-400:],
            "new": dict(counts, total=len(new)),
            "window_ms": window_ms,
            "first_failure_ms": None if first_fail is None else round((first_fail - act_start) * 1000),
            "failures_sample": [
                {"at_ms": round((x[0] - act_start) * 1000), "outcome": x[2], "detail": x[3][:120]} for x in failed[:5]
            ],
            "slowest_ok_ms": round(max(ok_lat) * 1000) if ok_lat else None,
            "long": {"opened": opened, "wanted": self.a.long, "kept": kept, "lost": lost},
        }
        if self.a.udp:
            sent = len(self.udp_sent)
            answered = sum(1 for s in self.udp_sent if s in self.udp_answered)
            out["udp"] = {"sent": sent, "answered": answered, "lost": sent - answered, "tags": self.udp_tags}
        return out


def summary(f):
    n = f["new"]
    s = (
        f"new {n['ok']}/{n['total']} ok, refused {n['refused']}, reset {n['reset']}, timeout {n['timeout']}, "
        f"other {n['other']}; window {f['window_ms']} ms; slowest ok {f['slowest_ok_ms']} ms; "
        f"long kept {f['long']['kept']} of {f['long']['wanted']}"
    )
    if "udp" in f:
        u = f["udp"]
        s += f"; udp {u['answered']}/{u['sent']} answered, lost {u['lost']}, backends {sorted(u['tags'])}"
    s += f"; action {f['action_ms']} ms rc {f['action_rc']}"
    return s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--tcp", required=True)
    s.add_argument("--udp")
    s.add_argument("--tag")
    r = sub.add_parser("run")
    r.add_argument("--tcp", required=True)
    r.add_argument("--udp")
    r.add_argument("--long", type=int, default=10)
    r.add_argument("--line-ms", type=float, default=100)
    r.add_argument("--new-ms", type=float, default=50)
    r.add_argument("--before", type=float, default=2)
    r.add_argument("--after", type=float, default=3)
    r.add_argument("--action-timeout", type=float, default=120)
    r.add_argument("--json")
    r.add_argument("action", nargs="+")
    a = p.parse_args()
    if a.mode == "serve":
        serve(a)
        return
    f = Run(a).go(a.action)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(f, fh, indent=1)
    print(summary(f), flush=True)


if __name__ == "__main__":
    sys.exit(main())
