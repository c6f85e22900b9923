#!/usr/bin/python3
"""tests/e2e/qmp.py — a small QMP client for the e2e tests and benchmarks (stdlib only).

  qmp.py SOCKET cmd NAME [JSON_ARGS]
      run one command; print its "return" as JSON. An error answer: its desc on stderr, exit 1.
  qmp.py SOCKET migrate URI [--pause-before-switchover] [--param NAME=VALUE]... [--timeout S]
      set the migration capabilities (`events`, and pause-before-switchover as asked) and
      parameters (migrate-set-parameters, VALUE as JSON or a string), issue `migrate`, poll
      query-migrate every 50 ms and print one JSON line: status, total-time, downtime,
      setup-time (ms), ram-transferred (bytes), error-desc. Exit 0 only on "completed".
      With --pause-before-switchover it returns (exit 0) at status "pre-switchover": the
      source is stopped, its disks still active; do what must happen then, then
      `qmp.py SOCKET continue` and `qmp.py SOCKET wait-migrate`. qemu's downtime then
      includes the time spent paused.
  qmp.py SOCKET continue               migrate-continue state=pre-switchover
  qmp.py SOCKET wait-migrate [--timeout S]
      poll query-migrate until completed, failed or cancelled; print the same JSON line
  qmp.py SOCKET wait-status STATUS [--timeout S]
      poll query-status (every 20 ms) until its status is STATUS ("running", "inmigrate",
      "postmigrate", "paused", ...); prints {"status": ..., "waited-ms": ...}

Connecting is retried for 10 s (qemu creates the socket at start-up). Timeouts default to
300 s; a timeout prints the last state and exits 1 (a migration is not cancelled). qemu
serves one QMP client at a time on a socket: don't run two of these at once on one VM.
Exit status: 0 ok, 1 error / failed / timed out, 2 usage.
"""
import argparse
import json
import socket
import sys
import time


class QMPError(Exception):
    pass


class QMP:
    def __init__(self, path, connect_secs=10.0, read_secs=60.0):
        deadline = time.monotonic() + connect_secs
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(read_secs)
            try:
                sock.connect(path)
                break
            except OSError as e:
                sock.close()
                if time.monotonic() >= deadline:
                    raise QMPError(f"cannot connect to {path}: {e}")
                time.sleep(0.1)
        self.f = sock.makefile("rwb")
        self.next_id = 0
        self.events = []
        greeting = self._read()
        if "QMP" not in greeting:
            raise QMPError(f"not a QMP greeting: {greeting}")
        self.cmd("qmp_capabilities")

    def _read(self):
        line = self.f.readline()
        if not line:
            raise QMPError("qemu closed the QMP connection")
        return json.loads(line)

    def cmd(self, name, args=None):
        """Runs NAME, returns its "return"; raises QMPError with the error's desc."""
        self.next_id += 1
        msg = {"execute": name, "id": self.next_id}
        if args:
            msg["arguments"] = args
        self.f.write(json.dumps(msg).encode() + b"\n")
        self.f.flush()
        while True:
            ans = self._read()
            if "event" in ans:  # asynchronous: kept, not waited for
                self.events.append(ans)
                continue
            if ans.get("id") != self.next_id:
                continue
            if "error" in ans:
                raise QMPError(f"{name}: {ans['error'].get('desc', ans['error'])}")
            return ans.get("return")


def migration_line(info):
    return {
        "status": info.get("status"),
        "total-time": info.get("total-time"),
        "downtime": info.get("downtime"),
        "setup-time": info.get("setup-time"),
        "ram-transferred": info.get("ram", {}).get("transferred"),
        "error-desc": info.get("error-desc"),
    }


def poll_migration(q, secs, stop_at=("completed", "failed", "cancelled")):
    deadline = time.monotonic() + secs
    while True:
        info = q.cmd("query-migrate")
        if info.get("status") in stop_at or time.monotonic() >= deadline:
            return info
        time.sleep(0.05)


def param_value(text):
    try:
        return json.loads(text)
    except ValueError:
        return text


def main():
    ap = argparse.ArgumentParser(prog="qmp.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("socket")
    sub = ap.add_subparsers(dest="op", required=True)
    c = sub.add_parser("cmd")
    c.add_argument("name")
    c.add_argument("args", nargs="?")
    m = sub.add_parser("migrate")
    m.add_argument("uri")
    m.add_argument("--pause-before-switchover", action="store_true")
    m.add_argument("--param", action="append", default=[])
    m.add_argument("--timeout", type=float, default=300)
    sub.add_parser("continue")
    w = sub.add_parser("wait-migrate")
    w.add_argument("--timeout", type=float, default=300)
    s = sub.add_parser("wait-status")
    s.add_argument("status")
    s.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()

    try:
        q = QMP(a.socket)
        if a.op == "cmd":
            args = json.loads(a.args) if a.args else None
            print(json.dumps(q.cmd(a.name, args)))
            return 0
        if a.op == "continue":
            q.cmd("migrate-continue", {"state": "pre-switchover"})
            return 0
        if a.op == "wait-status":
            t0 = time.monotonic()
            while True:
                st = q.cmd("query-status")["status"]
                if st == a.status or time.monotonic() - t0 >= a.timeout:
                    break
                time.sleep(0.02)
            print(json.dumps({"status": st, "waited-ms": round((time.monotonic() - t0) * 1000)}))
            if st != a.status:
                print(f"qmp.py: status still {st!r} after {a.timeout:g} s (want {a.status!r})", file=sys.stderr)
                return 1
            return 0
        if a.op == "migrate":
            caps = [{"capability": "events", "state": True},
                    {"capability": "pause-before-switchover", "state": a.pause_before_switchover}]
            q.cmd("migrate-set-capabilities", {"capabilities": caps})
            params = {}
            for p in a.param:
                name, _, value = p.partition("=")
                params[name] = param_value(value)
            if params:
                q.cmd("migrate-set-parameters", params)
            q.cmd("migrate", {"uri": a.uri})
            stop_at = ("completed", "failed", "cancelled")
            if a.pause_before_switchover:
                stop_at += ("pre-switchover",)
            info = poll_migration(q, a.timeout, stop_at)
        else:  # wait-migrate
            info = poll_migration(q, a.timeout)
        print(json.dumps(migration_line(info)))
        st = info.get("status")
        if st == "completed" or (st == "pre-switchover" and a.op == "migrate" and a.pause_before_switchover):
            return 0
        print(f"qmp.py: migration {st}" + (f": {info['error-desc']}" if info.get("error-desc") else ""), file=sys.stderr)
        return 1
    except (QMPError, OSError, ValueError) as e:
        print(f"qmp.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
