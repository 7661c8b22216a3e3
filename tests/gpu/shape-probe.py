#!/usr/bin/env python3
"""Shape probe (issue 7): what a UI session and a CUDA client each send on an MPS control socket,
what a daemon that is shutting down answers, what a refused client and a refused UI session see,
whether a gate that answers the daemon's hello itself still admits CUDA clients, and what
`start_server` does under a multi-user daemon. A measurement tool, not part of gpu-mps: the
manager's gate is built on what this prints.

    python3 tests/gpu/shape-probe.py --check <mps-check binary> --out <dir>

Runs as root on a machine with an NVIDIA GPU and the MPS binaries. It starts private MPS control
daemons (multi-user) under a temp dir, quits every one on exit, and never touches compute mode,
clocks, MIG or persistence. One JSON line per experiment on stdout; full traces in --out.
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
CONTROL = os.environ.get("SHAPE_PROBE_CONTROL", "nvidia-cuda-mps-control")
T0 = time.monotonic()
UID = 1000


def now():
    return round((time.monotonic() - T0) * 1000, 2)


def as_uid(uid):
    def pre():
        os.setgid(uid)
        os.setuid(uid)
    return pre if uid else None


class Daemon:
    def __init__(self, root, uuid):
        self.root = root
        self.pipe = os.path.join(root, "pipe")
        self.log = os.path.join(root, "log")
        os.makedirs(self.pipe, exist_ok=True)
        os.makedirs(self.log, exist_ok=True)
        for d in (root, self.pipe, self.log):
            os.chmod(d, 0o755)
        self.env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=self.pipe, CUDA_MPS_LOG_DIRECTORY=self.log,
                        CUDA_VISIBLE_DEVICES=uuid)
        subprocess.run([CONTROL, "-d", "-M"], env=self.env, check=True)
        for _ in range(100):
            if os.path.exists(os.path.join(self.pipe, "control")):
                break
            time.sleep(0.05)

    def ctl(self, command, timeout=10, uid=0):
        t = time.monotonic()
        try:
            r = subprocess.run([CONTROL], input=command + "\n", env=self.env, capture_output=True, text=True,
                               timeout=timeout, preexec_fn=as_uid(uid))
            return {"out": r.stdout.strip(), "err": r.stderr.strip(), "rc": r.returncode,
                    "s": round(time.monotonic() - t, 3)}
        except subprocess.TimeoutExpired:
            return {"out": None, "err": "timeout", "rc": None, "s": round(time.monotonic() - t, 3)}

    def servers(self):
        return [int(x) for x in (self.ctl("get_server_list")["out"] or "").split() if x.isdigit()]

    def set_limits(self, pct, mem):
        self.ctl(f"set_default_active_thread_percentage {pct}")
        self.ctl(f"set_default_device_pinned_mem_limit 0 {mem}")
        for s in self.servers():
            self.ctl(f"set_active_thread_percentage {s} {pct}")
            self.ctl(f"set_device_pinned_mem_limit {s} 0 {mem}")

    def quit(self):
        try:
            self.ctl("quit", timeout=15)
        except Exception:
            pass


def recv_msg(sock):
    """One SEQPACKET message: (data, creds, fds) or None at end of stream."""
    data, anc, flags, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(12) + socket.CMSG_SPACE(4 * 16))
    fds, creds = [], None
    for level, typ, cdata in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(cdata[: len(cdata) - (len(cdata) % 4)])
            fds.extend(a)
        elif level == socket.SOL_SOCKET and typ == SCM_CREDENTIALS:
            creds = struct.unpack("iII", cdata[:12])
    if not data and not anc:
        return None
    return data, creds, fds


def send_msg(sock, data, creds=None, fds=()):
    anc = []
    if creds:
        anc.append((socket.SOL_SOCKET, SCM_CREDENTIALS, struct.pack("iII", *creds)))
    if fds:
        anc.append((socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes()))
    sock.sendmsg([data], anc)


class Listener:
    """Serves <dir>/control; each accepted connection goes to handler(conn, client, peer) in a thread."""

    def __init__(self, gate_dir, name, handler):
        self.dir, self.name, self.handler = gate_dir, name, handler
        self.events, self.conns, self.held = [], 0, []
        os.makedirs(gate_dir, exist_ok=True)
        os.chmod(gate_dir, 0o755)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        path = os.path.join(gate_dir, "control")
        if os.path.exists(path):
            os.unlink(path)
        self.sock.bind(path)
        os.chmod(path, 0o777)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
        self.sock.listen(256)
        threading.Thread(target=self.loop, daemon=True).start()

    def ev(self, **kw):
        kw["t_ms"] = now()
        self.events.append(kw)

    def loop(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns += 1
            c.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
            peer = struct.unpack("iII", c.getsockopt(socket.SOL_SOCKET, SO_PEERCRED, 12))
            self.ev(conn=self.conns, what="open", peer=peer)
            threading.Thread(target=self.handler, args=(self, self.conns, c, peer), daemon=True).start()

    def close(self):
        self.sock.close()
        for c in self.held:
            try:
                c.close()
            except OSError:
                pass


def upstream_of(daemon):
    up = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    up.connect(os.path.join(daemon.pipe, "control"))
    up.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
    return up


def pump(lst, cid, client, up, peer, log_full=True, cut_after_fd=False):
    """Relays both ways until a side closes; every message logged in full."""
    peers = {client.fileno(): (client, up, "c2d"), up.fileno(): (up, client, "d2c")}
    got_fd = False
    try:
        while True:
            ready, _, _ = select.select(list(peers), [], [], 30)
            if not ready:
                lst.ev(conn=cid, what="idle-30s")
                return
            for fd in ready:
                src, dst, way = peers[fd]
                m = recv_msg(src)
                if m is None:
                    lst.ev(conn=cid, what="eof", way=way)
                    return
                data, creds, fds = m
                lst.ev(conn=cid, what="msg", way=way, size=len(data), hex=data[:256].hex(), creds=creds, fds=len(fds))
                send_msg(dst, data, peer if way == "c2d" else None, fds)
                for f in fds:
                    os.close(f)
                if way == "d2c" and fds:
                    got_fd = True
                    if cut_after_fd:
                        lst.ev(conn=cid, what="upstream-cut-after-fd")
                        up.close()
                        # the client's remaining messages are read and dropped until it closes
                        while True:
                            m = recv_msg(client)
                            if m is None:
                                lst.ev(conn=cid, what="eof", way="c2d")
                                return
                            lst.ev(conn=cid, what="msg-dropped", way="c2d", size=len(m[0]), hex=m[0].hex())
    finally:
        if not got_fd or not cut_after_fd:
            try:
                up.close()
            except OSError:
                pass
        client.close()
        lst.ev(conn=cid, what="closed")


def tracing_relay(daemon):
    def handler(lst, cid, client, peer):
        try:
            up = upstream_of(daemon)
        except OSError as e:
            # Never close the client here: that would be a direct context, not the daemon's answer.
            lst.ev(conn=cid, what="upstream-connect-failed", error=str(e))
            lst.held.append(client)
            return
        pump(lst, cid, client, up, peer)
    return handler


def local_hello_gate(daemon, hello, cut_after_fd=False, stats=None):
    """Answers the hello itself; reaches the daemon only once the client sent its request."""
    def handler(lst, cid, client, peer):
        send_msg(client, hello)
        req = []
        while len(req) < 2:
            m = recv_msg(client)
            if m is None:
                lst.ev(conn=cid, what="closed-before-request", msgs=len(req))
                client.close()
                return
            req.append(m[0])
            lst.ev(conn=cid, what="msg", way="c2d-local", size=len(m[0]), hex=m[0].hex(), creds=m[1])
        t = time.monotonic()
        up = upstream_of(daemon)
        h = recv_msg(up)
        lst.ev(conn=cid, what="upstream-hello", hex=h[0].hex() if h else None, same=(h is not None and h[0] == hello))
        for r in req:
            send_msg(up, r, peer)
        first = recv_msg(up)
        if stats is not None:
            stats.append(round((time.monotonic() - t) * 1000, 2))
        if first is None:
            lst.ev(conn=cid, what="upstream-eof-before-answer")
            up.close()
            client.close()
            return
        data, creds, fds = first
        lst.ev(conn=cid, what="msg", way="d2c", size=len(data), hex=data.hex(), fds=len(fds))
        send_msg(client, data, None, fds)
        for f in fds:
            os.close(f)
        if cut_after_fd and fds:
            lst.ev(conn=cid, what="upstream-cut-after-fd")
            up.close()
            while True:
                m = recv_msg(client)
                if m is None:
                    break
                lst.ev(conn=cid, what="msg-dropped", way="c2d", size=len(m[0]), hex=m[0].hex())
            client.close()
            lst.ev(conn=cid, what="closed")
            return
        pump(lst, cid, client, up, peer)
    return handler


def scripted(hello, after_request, keep_open=False):
    """A gate that never reaches a daemon: hello, read the request (2 messages or fewer), then
    send `after_request` (a list of bytes) and close (or keep the connection open)."""
    def handler(lst, cid, client, peer):
        if hello is not None:
            send_msg(client, hello)
        got = []
        client.settimeout(5)
        try:
            while len(got) < 2:
                m = recv_msg(client)
                if m is None:
                    break
                got.append(m[0].hex())
        except socket.timeout:
            lst.ev(conn=cid, what="request-timeout")
        lst.ev(conn=cid, what="request", msgs=got)
        for data in after_request:
            try:
                send_msg(client, data)
            except OSError as e:
                lst.ev(conn=cid, what="send-failed", error=str(e))
        if keep_open:
            lst.held.append(client)
        else:
            client.close()
        lst.ev(conn=cid, what="closed" if not keep_open else "kept")
    return handler


def run_client(check, pipe, tag, extra=(), timeout=40, uid=0):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS")}
    if pipe is not None:
        env["CUDA_MPS_PIPE_DIRECTORY"] = pipe
    t = time.monotonic()
    try:
        r = subprocess.run([check, "--tag", tag, *extra], env=env, capture_output=True, text=True, timeout=timeout,
                           preexec_fn=as_uid(uid))
    except subprocess.TimeoutExpired:
        return {"ok": None, "error": f"still waiting after {timeout} s", "wall_s": timeout}
    line = [l for l in r.stdout.splitlines() if l.startswith("{")]
    out = json.loads(line[-1]) if line else {"ok": False, "error": (r.stderr or r.stdout)[-300:]}
    out["rc"] = r.returncode
    out["wall_s"] = round(time.monotonic() - t, 3)
    out["stderr"] = r.stderr[-300:]
    return out


def brief(o):
    allocs = {a["mib"]: a["ok"] for a in o.get("allocs", [])}
    return {"ok": o.get("ok"), "sms": o.get("sms"), "free_mib": o.get("free_mib"), "allocs": allocs,
            "error": o.get("error"), "init_s": o.get("init_s"), "wall_s": o.get("wall_s"), "rc": o.get("rc"),
            "stderr": o.get("stderr")}


def cli_via(gate_dir, command, uid=0, timeout=8):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS")}
    env["CUDA_MPS_PIPE_DIRECTORY"] = gate_dir
    t = time.monotonic()
    try:
        r = subprocess.run([CONTROL], input=command + "\n", env=env, capture_output=True, text=True,
                           timeout=timeout, preexec_fn=as_uid(uid))
        return {"cmd": command, "uid": uid, "out": r.stdout.strip()[-300:], "err": r.stderr.strip()[-300:],
                "rc": r.returncode, "s": round(time.monotonic() - t, 3)}
    except subprocess.TimeoutExpired:
        return {"cmd": command, "uid": uid, "out": None, "err": f"timeout {timeout}s", "rc": None,
                "s": round(time.monotonic() - t, 3)}


def msgs(lst, way):
    return [e for e in lst.events if e.get("what") == "msg" and e.get("way") == way]


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.split()[0]
    root = tempfile.mkdtemp(prefix="shape-probe-", dir="/run")
    os.chmod(root, 0o755)
    daemons = []
    results = []
    traces = {}

    def emit(name, **kw):
        kw["experiment"] = name
        results.append(kw)
        print(json.dumps(kw), flush=True)
        with open(os.path.join(args.out, "shape-probe.json"), "w") as f:
            json.dump(results, f, indent=1)

    def new_daemon(name):
        d = Daemon(os.path.join(root, name), uuid)
        daemons.append(d)
        return d

    def keep_trace(name, lst):
        traces[name] = lst.events
        with open(os.path.join(args.out, "shape-traces.json"), "w") as f:
            json.dump(traces, f, indent=1)

    try:
        # 1. start_server under -M, before any client: does a server start, take limits, and serve
        #    root and uid-1000 clients?
        d1 = new_daemon("d1")
        d1.set_limits(25, "4G")
        before = d1.servers()
        r = d1.ctl("start_server -uid 0")
        time.sleep(0.3)
        after = d1.servers()
        srv = after[0] if after else None
        set_t = d1.ctl(f"set_active_thread_percentage {srv} 50") if srv else None
        set_m = d1.ctl(f"set_device_pinned_mem_limit {srv} 0 6G") if srv else None
        get_m = d1.ctl(f"get_device_pinned_mem_limit {srv} 0") if srv else None
        c_root = run_client(args.check, d1.pipe, "ss-root", ["--alloc-mib", "5000", "--alloc-mib", "7000"])
        c_user = run_client(args.check, d1.pipe, "ss-uid1000", ["--alloc-mib", "5000", "--alloc-mib", "7000"], uid=UID)
        emit("start-server", servers_before=before, answer=r, servers_after=after, set_threads=set_t,
             set_mem=set_m, get_mem=get_m, client_root=brief(c_root), client_uid1000=brief(c_user),
             servers_end=d1.servers())
        d1.quit()

        # 2. full traces of CUDA clients and UI sessions through a relay
        d2 = new_daemon("d2")
        d2.set_limits(25, "4G")
        tr = Listener(os.path.join(root, "g-trace"), "trace", tracing_relay(d2))
        cuda_root = run_client(args.check, tr.dir, "tr-root", ["--alloc-mib", "3000"])
        cuda_user = run_client(args.check, tr.dir, "tr-uid1000", ["--alloc-mib", "3000"], uid=UID)
        srv = d2.servers()
        cli = []
        for cmd, uid in (("get_server_list", 0), ("get_default_active_thread_percentage", 0),
                         (f"get_client_list {srv[0] if srv else 1}", 0), ("set_default_active_thread_percentage 30", 0),
                         ("get_server_list", UID), ("set_default_active_thread_percentage 90", UID),
                         ("terminate_client 1 1", 0), ("bogus_command", 0), ("quit_not_really", 0)):
            mark = len(tr.events)
            res = cli_via(tr.dir, cmd, uid)
            res["c2d"] = [(e["size"], e["hex"]) for e in tr.events[mark:] if e.get("way") == "c2d" and e.get("what") == "msg"]
            res["d2c"] = [(e["size"], e["hex"], e["fds"]) for e in tr.events[mark:] if e.get("way") == "d2c" and e.get("what") == "msg"]
            cli.append(res)
        d2.ctl("set_default_active_thread_percentage 25")
        keep_trace("relay", tr)
        hello = next((bytes.fromhex(e["hex"]) for e in msgs(tr, "d2c")), None)
        emit("traces", cuda_root=brief(cuda_root), cuda_uid1000=brief(cuda_user),
             cuda_c2d_shapes=sorted({(e["size"], e["hex"]) for e in msgs(tr, "c2d")}), cli=cli,
             hello=hello.hex() if hello else None)
        tr.close()

        # 3. local hello: the gate answers the hello itself and reaches the daemon only with a request
        stats = []
        lh = Listener(os.path.join(root, "g-local"), "local", local_hello_gate(d2, hello, stats=stats))
        a = run_client(args.check, lh.dir, "lh-root", ["--alloc-mib", "3000", "--alloc-mib", "5000"])
        b = run_client(args.check, lh.dir, "lh-uid1000", ["--alloc-mib", "3000", "--alloc-mib", "5000"], uid=UID)
        clients_now = {s: d2.ctl(f"get_client_list {s}")["out"] for s in d2.servers()}
        keep_trace("local-hello", lh)
        emit("local-hello", root=brief(a), uid1000=brief(b), upstream_connections=len(stats),
             gate_connections=lh.conns, request_to_answer_ms=stats,
             upstream_hello_same=[e.get("same") for e in lh.events if e.get("what") == "upstream-hello"],
             client_lists_after=clients_now)
        lh.close()

        # 3b. local hello, and the daemon's end closed as soon as the descriptor was passed
        lc = Listener(os.path.join(root, "g-cut"), "cut", local_hello_gate(d2, hello, cut_after_fd=True))
        a = run_client(args.check, lc.dir, "cut", ["--alloc-mib", "3000", "--alloc-mib", "5000", "--busy-seconds", "1"])
        keep_trace("cut-after-fd", lc)
        emit("local-hello-cut-after-fd", client=brief(a), servers=d2.servers())
        lc.close()

        # 3c. 64 silent connections on a local-hello gate, then a client through another one
        silent_gate = Listener(os.path.join(root, "g-silent-victim"), "silentv", local_hello_gate(d2, hello))
        other = Listener(os.path.join(root, "g-other"), "other", local_hello_gate(d2, hello))
        held = []
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(os.path.join(silent_gate.dir, "control"))
            held.append(s)
        time.sleep(0.3)
        v = run_client(args.check, other.dir, "beside-64-silent", ["--alloc-mib", "3000"])
        base = run_client(args.check, other.dir, "baseline", ["--alloc-mib", "3000"])
        for s in held:
            s.close()
        emit("silent-64", victim=brief(v), baseline=brief(base))
        silent_gate.close()
        other.close()

        # 4. what a daemon that is shutting down answers: a client holds the server, `quit` is sent,
        #    then a new client and a UI session connect through a tracing relay
        hold = threading.Thread(target=lambda: run_client(args.check, d2.pipe, "holder", ["--hold-seconds", "8"]))
        hold.start()
        time.sleep(2.0)
        q = {}
        qt = threading.Thread(target=lambda: q.update(d2.ctl("quit", timeout=20)))
        qt.start()
        time.sleep(0.5)
        sd = Listener(os.path.join(root, "g-shutdown"), "shutdown", tracing_relay(d2))
        refused = run_client(args.check, sd.dir, "during-quit", ["--alloc-mib", "5000"], timeout=15)
        client_d2c = [bytes.fromhex(e["hex"]) for e in msgs(sd, "d2c")]
        ui_refused = cli_via(sd.dir, "get_server_list")
        keep_trace("shutdown", sd)
        refusal = [m for m in client_d2c if m != hello][:2]
        hold.join()
        qt.join()
        emit("shutdown-answer", client=brief(refused), ui=ui_refused, quit=q,
             d2c=[(e["conn"], e["size"], e["hex"], e["fds"]) for e in msgs(sd, "d2c")],
             c2d=[(e["conn"], e["size"], e["hex"]) for e in msgs(sd, "c2d")])
        sd.close()

        # 5. what refused clients and UI sessions see from a gate that never reaches a daemon
        d3 = new_daemon("d3")
        d3.set_limits(25, "4G")
        d3_first = run_client(args.check, d3.pipe, "d3-first")  # a server exists from now on
        variants = [
            ("close-after-request", hello, [], False),
            ("shutdown-replay", hello, refusal[:1], False),
            ("shutdown-replay-all", hello, refusal, False),
            ("hello-then-silent", hello, [], True),
        ]
        for name, h, after, keep in variants:
            g = Listener(os.path.join(root, f"g-{name}"), name, scripted(h, after, keep))
            c = run_client(args.check, g.dir, name, ["--alloc-mib", "5000"], timeout=12)
            u = cli_via(g.dir, "get_server_list", timeout=6)
            u2 = cli_via(g.dir, "set_default_active_thread_percentage 100", timeout=6)
            keep_trace(name, g)
            emit(f"refusal-{name}", client=brief(c), ui=u, ui_set=u2,
                 requests=[e.get("msgs") for e in g.events if e.get("what") == "request"])
            g.close()
        emit("d3-check", first=brief(d3_first), servers=d3.servers(), defaults=d3.ctl("get_default_active_thread_percentage"))
        d3.quit()

        # 6. the handshake of the first client of a new daemon (the server starts inside it), with
        #    and without start_server first
        for name, pre in (("cold", False), ("prestarted", True)):
            d = new_daemon(f"d4-{name}")
            d.set_limits(25, "4G")
            if pre:
                d.ctl("start_server -uid 0")
            stats = []
            g = Listener(os.path.join(root, f"g-{name}"), name, local_hello_gate(d, hello, stats=stats))
            c = run_client(args.check, g.dir, name, ["--alloc-mib", "3000", "--alloc-mib", "5000"])
            c2 = run_client(args.check, g.dir, name + "-2", ["--alloc-mib", "3000"])
            emit(f"first-client-{name}", client=brief(c), second=brief(c2), request_to_answer_ms=stats,
                 servers=d.servers())
            g.close()
            d.quit()
    finally:
        for d in daemons:
            d.quit()
        for i, d in enumerate(daemons):
            for name in ("control.log", "server.log"):
                try:
                    with open(os.path.join(d.log, name)) as src, open(os.path.join(args.out, f"d{i}-{name}"), "w") as dst:
                        dst.write(src.read()[-100000:])
                except OSError:
                    pass


if __name__ == "__main__":
    sys.exit(main())
