#!/usr/bin/env python3
"""Connect-gate probe (Q7): what crosses an MPS control socket, and when the server latches a
client's limits. A measurement tool, not part of gpu-mps: the manager's gate (manager/src/gate.rs)
is built on what this prints.

    python3 tests/gpu/gate-probe.py --check <mps-check binary> --out <dir>

Runs as root on a machine with an NVIDIA GPU and the MPS binaries. It starts ONE private MPS
control daemon (multi-user) under a temp dir, quits it on exit, and never touches compute mode,
clocks, MIG or persistence. Prints one JSON line per experiment and writes traces to --out.

Experiments:
  trace     one client through a relaying gate: every message (direction, size, credentials,
            passed fds), when each connection opens and closes, relative to the client's exit
  latch-*   the gate sets the client's limits (25 %, 3G), relays, and at a chosen point of the
            handshake sets a sentinel (75 %, 20G): the client's SMs and allocations tell whether
            its limits were already latched at that point
  dead      the gate dir holds a `control` socket nobody listens on (a manager that is down);
            empty: the gate dir is empty
  burst-N   N clients with different limits start together, each through its own gate, with one
            lock per server held from a client's first connection until its last one closed
"""
import argparse
import array
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

SO_PASSCRED = 16
SO_PEERCRED = 17
SCM_CREDENTIALS = 2
CONTROL = os.environ.get("GATE_PROBE_CONTROL", "nvidia-cuda-mps-control")
T0 = time.monotonic()


def now():
    return round((time.monotonic() - T0) * 1000, 2)


class Daemon:
    def __init__(self, root, uuid):
        self.pipe = os.path.join(root, "pipe")
        self.log = os.path.join(root, "log")
        os.makedirs(self.pipe, exist_ok=True)
        os.makedirs(self.log, exist_ok=True)
        os.chmod(root, 0o755)
        self.env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=self.pipe, CUDA_MPS_LOG_DIRECTORY=self.log,
                        CUDA_VISIBLE_DEVICES=uuid)
        subprocess.run([CONTROL, "-d", "-M"], env=self.env, check=True)
        for _ in range(100):
            if os.path.exists(os.path.join(self.pipe, "control")):
                break
            time.sleep(0.05)

    def ctl(self, command):
        r = subprocess.run([CONTROL], input=command + "\n", env=self.env, capture_output=True, text=True, timeout=10)
        return r.stdout.strip()

    def servers(self):
        return [int(x) for x in self.ctl("get_server_list").split() if x.isdigit()]

    def set_limits(self, pct, mem):
        t = time.monotonic()
        self.ctl(f"set_default_active_thread_percentage {pct}")
        self.ctl(f"set_default_device_pinned_mem_limit 0 {mem}")
        for s in self.servers():
            self.ctl(f"set_active_thread_percentage {s} {pct}")
            self.ctl(f"set_device_pinned_mem_limit {s} 0 {mem}")
        return round((time.monotonic() - t) * 1000, 1)

    def quit(self):
        try:
            self.ctl("quit")
        except Exception:
            pass


class AdmissionLock:
    """One per server: held by one gate from its client's first connection until its last closed."""

    def __init__(self):
        self.cv = threading.Condition()
        self.holder = None
        self.open = 0
        self.waits = []
        self.holds = []
        self.since = 0.0

    def enter(self, owner, on_acquire):
        t = time.monotonic()
        with self.cv:
            while self.holder not in (None, owner):
                self.cv.wait()
            if self.holder is None:
                self.holder = owner
                self.since = time.monotonic()
                self.waits.append(round((self.since - t) * 1000, 1))
                on_acquire()
            self.open += 1

    def leave(self, owner, grace):
        with self.cv:
            self.open -= 1
            if self.open > 0:
                return
        time.sleep(grace)
        with self.cv:
            if self.holder == owner and self.open == 0:
                self.holds.append(round((time.monotonic() - self.since) * 1000, 1))
                self.holder = None
                self.cv.notify_all()


class Gate:
    """Serves <dir>/control and relays each connection to the daemon's control socket."""

    def __init__(self, gate_dir, daemon, name, on_connect=None, on_event=None, lock=None, grace=0.05,
                 before_upstream=None):
        self.before_upstream = before_upstream
        self.dir, self.daemon, self.name = gate_dir, daemon, name
        self.on_connect, self.on_event, self.lock, self.grace = on_connect, on_event, lock, grace
        self.events = []
        self.conns = 0
        os.makedirs(gate_dir, exist_ok=True)
        os.chmod(gate_dir, 0o755)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        path = os.path.join(gate_dir, "control")
        if os.path.exists(path):
            os.unlink(path)
        self.sock.bind(path)
        os.chmod(path, 0o777)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
        self.sock.listen(64)
        threading.Thread(target=self.accept_loop, daemon=True).start()

    def ev(self, **kw):
        kw["t_ms"] = now()
        kw["gate"] = self.name
        self.events.append(kw)
        if self.on_event:
            self.on_event(kw)

    def accept_loop(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns += 1
            threading.Thread(target=self.relay, args=(c, self.conns), daemon=True).start()

    def relay(self, client, cid):
        client.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
        pid, uid, gid = struct.unpack("iII", client.getsockopt(socket.SOL_SOCKET, SO_PEERCRED, 12))
        self.ev(conn=cid, what="open", peer_pid=pid, peer_uid=uid)
        if self.lock:
            self.lock.enter(self.name, lambda: self.on_connect and self.on_connect())
        elif self.on_connect:
            self.on_connect()
        if self.before_upstream:
            self.before_upstream(cid)
        up = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        up.connect(os.path.join(self.daemon.pipe, "control"))
        up.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
        self.ev(conn=cid, what="upstream-connected")
        peers = {client.fileno(): (client, up, "c2d"), up.fileno(): (up, client, "d2c")}
        try:
            while True:
                ready, _, _ = select.select(list(peers), [], [], 30)
                if not ready:
                    self.ev(conn=cid, what="idle-30s")
                    break
                done = False
                for fd in ready:
                    src, dst, way = peers[fd]
                    data, anc, flags, _ = src.recvmsg(1 << 16, socket.CMSG_SPACE(12) + socket.CMSG_SPACE(4 * 16))
                    fds, creds = [], None
                    for level, typ, cdata in anc:
                        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                            a = array.array("i")
                            a.frombytes(cdata[: len(cdata) - (len(cdata) % 4)])
                            fds.extend(a)
                        elif level == socket.SOL_SOCKET and typ == SCM_CREDENTIALS:
                            creds = struct.unpack("iII", cdata[:12])
                    if not data and not anc:
                        self.ev(conn=cid, what="eof", way=way)
                        done = True
                        break
                    self.ev(conn=cid, what="msg", way=way, size=len(data), head=data[:24].hex(),
                            creds=creds, fds=len(fds), flags=flags)
                    out = []
                    if way == "c2d":
                        c = creds or (pid, uid, gid)
                        out.append((socket.SOL_SOCKET, SCM_CREDENTIALS, struct.pack("iII", *c)))
                    if fds:
                        out.append((socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes()))
                    dst.sendmsg([data], out)
                    for f in fds:
                        os.close(f)
                if done:
                    break
        finally:
            client.close()
            up.close()
            self.ev(conn=cid, what="closed")
            if self.lock:
                self.lock.leave(self.name, self.grace)

    def close(self):
        self.sock.close()


def run_client(check, pipe, tag, extra=(), env_extra=None, timeout=40):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS")}
    if pipe is not None:
        env["CUDA_MPS_PIPE_DIRECTORY"] = pipe
    env.update(env_extra or {})
    t = now()
    r = subprocess.run([check, "--tag", tag, *extra], env=env, capture_output=True, text=True, timeout=timeout)
    line = [l for l in r.stdout.splitlines() if l.startswith("{")]
    out = json.loads(line[-1]) if line else {"ok": False, "error": (r.stderr or r.stdout)[-300:]}
    out["t_start_ms"], out["t_exit_ms"] = t, now()
    return out


def brief(o):
    allocs = {a["mib"]: a["ok"] for a in o.get("allocs", [])}
    return {"ok": o.get("ok"), "sms": o.get("sms"), "free_mib": o.get("free_mib"), "allocs": allocs,
            "error": o.get("error"), "init_s": o.get("init_s")}


def main():
    # A timeout's SIGTERM must still quit the daemon (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    uuid = os.environ.get("GATE_PROBE_UUID") or subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True).stdout.split()[0]
    root = tempfile.mkdtemp(prefix="gate-probe-", dir="/run")
    os.chmod(root, 0o755)
    d = Daemon(os.path.join(root, "daemon"), uuid)
    results = []

    def emit(name, **kw):
        kw["experiment"] = name
        results.append(kw)
        print(json.dumps(kw), flush=True)

    try:
        # trace: first client (starts the server), second client (server exists), held client
        d.set_limits(25, "4G")
        g = Gate(os.path.join(root, "g-trace"), d, "trace")
        first = run_client(args.check, g.dir, "first", ["--alloc-mib", "3000", "--alloc-mib", "5000"])
        second = run_client(args.check, g.dir, "second", ["--alloc-mib", "3000"])
        held = run_client(args.check, g.dir, "held", ["--hold-seconds", "2"])
        with open(os.path.join(args.out, "gate-trace.json"), "w") as f:
            json.dump({"events": g.events, "clients": [first, second, held]}, f, indent=1)
        emit("trace", first=brief(first), second=brief(second), held=brief(held), servers=d.servers(),
             messages=sum(1 for e in g.events if e["what"] == "msg"),
             conns=g.conns, fd_msgs=sum(1 for e in g.events if e.get("fds")))
        g.close()

        # latch-after-K: the client's limits are 25/3G; right after its K-th control connection
        # closed, the sentinel 75/20G is set, and its next connection waits until that is done (the
        # control daemon serves one connection at a time: a command sent while a client's
        # connection is open waits for it, see the trace). Which K still leaves the client its own
        # limits tells when the server has them. After each close: does get_client_list show it?
        def latch(k):
            d.set_limits(25, "3G")
            state = {}
            sentinel_done = threading.Event()

            def on_event(e):
                if e["what"] == "closed" and e["conn"] == k:
                    srv = d.servers()
                    state["lists"] = {s: d.ctl(f"get_client_list {s}").split() for s in srv}
                    state["at_ms"] = e["t_ms"]
                    state["set_ms"] = d.set_limits(75, "20G")
                    sentinel_done.set()

            def before_upstream(cid):
                # Connections are numbered in accept order: those after the K-th wait for the sentinel.
                if cid > k:
                    sentinel_done.wait(30)

            g = Gate(os.path.join(root, f"g-latch-{k}"), d, f"latch{k}", on_event=on_event,
                     before_upstream=before_upstream)
            o = run_client(args.check, g.dir, f"latch{k}", ["--alloc-mib", "2000", "--alloc-mib", "5000"])
            emit(f"latch-after-{k}", client=brief(o), client_pid=o.get("pid"), sentinel_at_ms=state.get("at_ms"),
                 sentinel_set_ms=state.get("set_ms"), conns=g.conns, client_list_at_sentinel=state.get("lists"),
                 own_limits=(o.get("sms") is not None and o.get("sms") < 60))
            g.close()

        for k in (1, 2, 3):
            latch(k)

        # stall: a connection that says nothing holds the control daemon (one connection at a time)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw.connect(os.path.join(d.pipe, "control"))
        time.sleep(0.2)
        t = time.monotonic()
        try:
            stalled = subprocess.run([CONTROL], input="get_server_list\n", env=d.env, capture_output=True,
                                     text=True, timeout=3).stdout.strip()
        except subprocess.TimeoutExpired:
            stalled = "timeout"
        stalled_s = round(time.monotonic() - t, 2)
        raw.close()
        t = time.monotonic()
        after = d.ctl("get_server_list")
        emit("stall", answer_while_stalled=stalled, waited_s=stalled_s, answer_after_close=after,
             after_s=round(time.monotonic() - t, 2))

        # dead gate / empty gate
        dead_dir = os.path.join(root, "g-dead")
        os.makedirs(dead_dir)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(os.path.join(dead_dir, "control"))
        s.close()
        emit("dead", client=brief(run_client(args.check, dead_dir, "dead", ["--alloc-mib", "5000"])))
        empty_dir = os.path.join(root, "g-empty")
        os.makedirs(empty_dir)
        emit("empty", client=brief(run_client(args.check, empty_dir, "empty", ["--alloc-mib", "5000"])))

        # a gate that accepts and closes at once, and one that accepts and never answers
        class Refusing:
            def __init__(self, gate_dir, silent):
                os.makedirs(gate_dir)
                self.dir, self.held = gate_dir, []
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                self.sock.bind(os.path.join(gate_dir, "control"))
                self.sock.listen(16)
                threading.Thread(target=self.loop, args=(silent,), daemon=True).start()

            def loop(self, silent):
                while True:
                    try:
                        c, _ = self.sock.accept()
                    except OSError:
                        return
                    if silent:
                        self.held.append(c)
                    else:
                        c.close()

        for name, silent in (("gate-closes", False), ("gate-silent", True)):
            r = Refusing(os.path.join(root, f"g-{name}"), silent)
            try:
                out = brief(run_client(args.check, r.dir, name, ["--alloc-mib", "5000"], timeout=12))
            except subprocess.TimeoutExpired:
                out = {"ok": None, "error": "no answer within 12 s (client still waiting)"}
            emit(name, client=out, connections=len(r.held))
            r.sock.close()
            for c in r.held:
                c.close()

        # burst-N: N gates with their own limits, one lock, all clients start together
        for n in (4, 8):
            lock = AdmissionLock()
            gates, outs = [], [None] * n
            plan = [(10 + 10 * (i % 8), f"{2 + i}G") for i in range(n)]
            for i, (pct, mem) in enumerate(plan):
                gates.append(Gate(os.path.join(root, f"g-burst{n}-{i}"), d, f"b{n}-{i}",
                                  on_connect=(lambda p=pct, m=mem: d.set_limits(p, m)), lock=lock, grace=0.15))

            def go(i):
                outs[i] = run_client(args.check, gates[i].dir, f"b{n}-{i}",
                                     ["--alloc-mib", str(int(plan[i][1][:-1]) * 1024 - 700),
                                      "--alloc-mib", str(int(plan[i][1][:-1]) * 1024 + 600), "--hold-seconds", "1"])

            ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
            t = time.monotonic()
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            wall = round(time.monotonic() - t, 2)
            rows = []
            for i, o in enumerate(outs):
                b = brief(o)
                rows.append({"want_pct": plan[i][0], "want_mem": plan[i][1], **b})
            gaps = []
            for g in gates:
                ev = [e for e in g.events if e["what"] in ("open", "closed")]
                gaps += [round(b["t_ms"] - a["t_ms"], 1) for a, b in zip(ev, ev[1:]) if a["what"] == "closed" and b["what"] == "open"]
            emit(f"burst-{n}", wall_s=wall, lock_waits_ms=lock.waits, lock_holds_ms=lock.holds, clients=rows,
                 conns=[g.conns for g in gates], fd_msgs=[sum(1 for e in g.events if e.get("fds")) for g in gates],
                 gaps_between_connections_ms=sorted(gaps)[-6:])
            for g in gates:
                g.close()
    finally:
        d.quit()
        with open(os.path.join(args.out, "gate-probe.json"), "w") as f:
            json.dump(results, f, indent=1)
        for name in ("control.log", "server.log"):
            try:
                with open(os.path.join(d.log, name)) as src, open(os.path.join(args.out, f"probe-{name}"), "w") as dst:
                    dst.write(src.read()[-200000:])
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
