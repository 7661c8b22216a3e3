#!/usr/bin/env python3
"""Channel probe (issue 7, H2.noack): what a client that takes its channel from the MPS control
daemon and then does not use it does to the daemon and to the next client. A measurement tool,
not part of gpu-mps.

    python3 tests/gpu/channel-probe.py --check <mps-check binary>

For each variant, a fresh private multi-user daemon with a running server; the "hostile" side
speaks the measured request (OUTBCRED, kind 2) directly to the daemon's control socket, then:
  hold        keeps the channel descriptor open, sends no acknowledgement
  close       closes the channel at once, sends no acknowledgement
  ack-hold    acknowledges, keeps the channel open
  ack-close   acknowledges, closes the channel at once
and closes its control connection after 0.5 s (as the gate does). Then: does the control CLI
answer, how long does a new CUDA client take, and does the daemon recover once the channel is
closed. Quits (or kills) every daemon and server it started.
"""
import argparse
import array
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

CONTROL = "nvidia-cuda-mps-control"
SO_PASSCRED = 16
SCM_CREDENTIALS = 2


def ctl(env, command, timeout=5):
    t = time.monotonic()
    try:
        r = subprocess.run([CONTROL], input=command + "\n", env=env, capture_output=True, text=True, timeout=timeout)
        return {"out": r.stdout.strip()[:100], "rc": r.returncode, "s": round(time.monotonic() - t, 3)}
    except subprocess.TimeoutExpired:
        return {"out": None, "rc": None, "s": round(time.monotonic() - t, 3), "timeout": True}


def client(check, pipe, timeout=15):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS")}
    env["CUDA_MPS_PIPE_DIRECTORY"] = pipe
    t = time.monotonic()
    try:
        r = subprocess.run([check, "--alloc-mib", "3000", "--alloc-mib", "5000"], env=env, capture_output=True,
                           text=True, timeout=timeout)
        line = [l for l in r.stdout.splitlines() if l.startswith("{")]
        out = json.loads(line[-1]) if line else {"ok": False, "error": r.stderr[-200:]}
    except subprocess.TimeoutExpired:
        out = {"ok": None, "error": f"no answer within {timeout} s"}
    return {"ok": out.get("ok"), "sms": out.get("sms"), "error": out.get("error"), "wall_s": round(time.monotonic() - t, 2)}


def take_channel(pipe):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
    s.settimeout(10)
    s.connect(os.path.join(pipe, "control"))
    hello = s.recv(64)
    creds = [(socket.SOL_SOCKET, SCM_CREDENTIALS, struct.pack("iII", os.getpid(), 0, 0))]
    s.sendmsg([b"OUTBCRED\0"], creds)
    s.sendmsg([struct.pack("<I", 2)], creds)
    data, anc, flags, _ = s.recvmsg(64, socket.CMSG_SPACE(12) + socket.CMSG_SPACE(4 * 8))
    fds = []
    for level, kind, blob in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(blob[: len(blob) - len(blob) % 4])
            fds.extend(a)
    return s, hello, data, fds, flags


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", required=True)
    ap.add_argument("variants", nargs="*")
    args = ap.parse_args()
    uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.split()[0]
    variants = args.variants or ["hold", "close", "ack-hold", "ack-close"]
    for variant in variants:
        root = tempfile.mkdtemp(prefix="channel-probe-", dir="/run")
        os.chmod(root, 0o755)
        pipe, log = os.path.join(root, "pipe"), os.path.join(root, "log")
        os.makedirs(pipe)
        os.makedirs(log)
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=log, CUDA_VISIBLE_DEVICES=uuid)
        subprocess.run([CONTROL, "-d", "-M"], env=env, check=True)
        time.sleep(0.3)
        daemon_pid = int(open(os.path.join(pipe, "nvidia-cuda-mps-control.pid")).read().strip())
        ctl(env, "set_default_active_thread_percentage 25")
        ctl(env, "set_default_device_pinned_mem_limit 0 4G")
        warm = client(args.check, pipe)
        servers = [int(x) for x in (ctl(env, "get_server_list")["out"] or "").split() if x.isdigit()]
        row = {"variant": variant, "warm": warm, "servers": servers}
        if variant in ("pair", "exit", "exit-noack"):
            # The taker is a child process: it can exit, as a pod's process would.
            code = f"""
import sys, time; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import importlib.util as u
spec = u.spec_from_file_location('cp', {os.path.abspath(__file__)!r}); cp = u.module_from_spec(spec); spec.loader.exec_module(cp)
import socket, struct, os
held = []
for _ in range({2 if variant == 'pair' else 1}):
    s, hello, data, fds, flags = cp.take_channel({pipe!r})
    if {variant != 'exit-noack'!r}:
        s.sendmsg([b'\\0\\0\\0\\0'], [(socket.SOL_SOCKET, 2, struct.pack('iII', os.getpid(), 0, 0))])
    time.sleep(0.3); s.close(); held.append(fds)
print(len(held), flush=True)
time.sleep({30 if variant == 'pair' else 0})
"""
            taker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            row["taker_took"] = taker.stdout.readline().strip()
            if variant != "pair":
                taker.wait(timeout=10)
            fds = []
        else:
            s, hello, data, fds, flags = take_channel(pipe)
            row["answer"] = {"hello": hello.hex(), "data": data.hex(), "fds": len(fds), "flags": flags}
            if variant.startswith("ack"):
                s.sendmsg([b"\0\0\0\0"], [(socket.SOL_SOCKET, SCM_CREDENTIALS, struct.pack("iII", os.getpid(), 0, 0))])
            if variant.endswith("close"):
                for fd in fds:
                    os.close(fd)
                fds = []
            time.sleep(0.5)
            s.close()
        row["cli_after"] = ctl(env, "get_server_list")
        row["client_after"] = client(args.check, pipe)
        for fd in fds:
            os.close(fd)
        if variant == "pair":
            taker.kill()
            taker.wait()
        time.sleep(2)
        row["cli_released"] = ctl(env, "get_server_list")
        row["client_released"] = client(args.check, pipe)
        q = ctl(env, "quit", timeout=8)
        time.sleep(1)
        left = []
        for pid in [daemon_pid, *servers]:
            try:
                os.kill(pid, 0)
                os.kill(pid, signal.SIGKILL)
                left.append(pid)
            except OSError:
                pass
        row["quit"] = q
        row["killed_after_quit"] = left
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
