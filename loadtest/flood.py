#!/usr/bin/env python3
"""Connection floods against a rolter gateway on loopback (loadtest/flood.sh, loadtest/soak.sh).

  flood.py measure --port P --pid PID [--idle N --slow N --big N --dribble-secs S --requests N]
      Run the phases of loadtest/flood.sh against the gateway listening on P (process PID)
      and print the report's table (markdown) on stdout.
  flood.py idle --port P --connections N --hold-secs S
      Open N idle connections, hold them S seconds, close them; print one line:
      "opened N, closed by the gateway M".

Standard library only. Every socket is closed on exit.
"""

import argparse
import http.client
import json
import os
import select
import socket
import statistics
import sys
import time

CHAT_BODY = json.dumps({
    "model": "bench",
    "messages": [
        {"role": "system", "content": "You are a careful assistant. " * 70},
        {"role": "user", "content": "question 1 " * 170},
    ],
})
SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: flood\r\nX-Pad: "


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(port, name):
    """The value of an unlabelled metric, or None (not exported, or the scrape failed)."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
        c.close()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def latencies(port, n):
    """n chat requests on one keep-alive connection; (p50 ms, p99 ms, failures)."""
    times, failures = [], 0
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for _ in range(n):
        start = time.perf_counter()
        try:
            c.request("POST", "/v1/chat/completions", CHAT_BODY, {"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            if r.status != 200:
                failures += 1
                continue
        except (OSError, http.client.HTTPException):
            failures += 1
            c.close()
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            continue
        times.append((time.perf_counter() - start) * 1000)
    c.close()
    if not times:
        return float("nan"), float("nan"), failures
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))], failures


def open_many(port, n, first=b""):
    """n connections, each sending `first` (if any); the ones that connected."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
            if first:
                s.sendall(first)
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def closed_by_peer(socks):
    """How many of `socks` the gateway has closed (readable: EOF, a reset, or an answer)."""
    closed = 0
    for i in range(0, len(socks), 512):
        chunk = socks[i:i + 512]
        p = select.poll()
        for s in chunk:
            p.register(s, select.POLLIN | select.POLLHUP | select.POLLERR)
        closed += len(p.poll(0))
    return closed


def close_all(socks):
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


def row(cells):
    print("| " + " | ".join(str(c) for c in cells) + " |")


def fmt_ms(v):
    return "–" if v != v else f"{v:.2f}"


def measure(a):
    pid, port = a.pid, a.port
    gauge = lambda: metric(port, "rolter_client_connections")
    print("| phase | gateway RSS MiB | open connections (gauge) | closed by the gateway | "
          "normal client p50 / p99 ms (failed) | gateway CPU s in phase |")
    print("|---|---:|---:|---:|---:|---:|")

    def sample(phase, closed="–", cpu="–", requests=a.requests):
        p50, p99, failed = latencies(port, requests) if requests else (float("nan"),) * 2 + (0,)
        g = gauge()
        row([phase, f"{rss_mib(pid):.1f}", "n/a" if g is None else int(g), closed,
             f"{fmt_ms(p50)} / {fmt_ms(p99)} ({failed})", cpu])
        return p50

    latencies(port, 100)  # warm-up
    base = sample("start (after 100 warm-up requests)")

    socks = open_many(port, a.idle)
    time.sleep(3)
    p50 = sample(f"{len(socks)} idle connections held", closed=closed_by_peer(socks))
    close_all(socks)
    time.sleep(5)
    sample("5 s after closing them")
    time.sleep(15)
    after = sample("20 s after closing them")

    socks = open_many(port, a.slow, SLOW_HEAD + b"a" * 1000)
    time.sleep(3)
    sample(f"{len(socks)} slowloris headers (1 KiB, unfinished) held", closed=closed_by_peer(socks))
    close_all(socks)
    time.sleep(5)
    sample("5 s after closing them")

    cpu0 = cpu_s(pid)
    socks = open_many(port, a.big, SLOW_HEAD + b"a" * 900_000)
    sent_cpu = cpu_s(pid) - cpu0
    sample(f"{len(socks)} unfinished 900 KB headers sent", closed=closed_by_peer(socks),
           cpu=f"{sent_cpu:.2f}")
    cpu1 = cpu_s(pid)
    end = time.monotonic() + a.dribble_secs
    live = list(socks)
    while time.monotonic() < end and live:
        keep = []
        for s in live:
            try:
                s.send(b"a")
                keep.append(s)
            except OSError:
                pass
        live = keep
        time.sleep(0.1)
    dribble_cpu = cpu_s(pid) - cpu1
    sample(f"then a byte per 100 ms on each for {a.dribble_secs} s ({len(live)} still open at the end)",
           closed=closed_by_peer(socks), cpu=f"{dribble_cpu:.2f}")
    close_all(socks)
    time.sleep(5)
    sample("5 s after closing them")
    print()
    print(f"Normal client p50 with the idle connections held: {p50 / base:.2f}x its start "
          f"({fmt_ms(p50)} vs {fmt_ms(base)} ms); 20 s after they closed: {after / base:.2f}x.")


def idle(a):
    socks = open_many(a.port, a.connections)
    time.sleep(a.hold_secs)
    closed = closed_by_peer(socks)
    close_all(socks)
    print(f"opened {len(socks)}, closed by the gateway {closed}")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--pid", type=int, required=True)
    m.add_argument("--idle", type=int, default=7000)
    m.add_argument("--slow", type=int, default=2000)
    m.add_argument("--big", type=int, default=300)
    m.add_argument("--dribble-secs", type=int, default=10)
    m.add_argument("--requests", type=int, default=400)
    i = sub.add_parser("idle")
    i.add_argument("--port", type=int, required=True)
    i.add_argument("--connections", type=int, default=7000)
    i.add_argument("--hold-secs", type=float, default=10)
    a = p.parse_args()
    {"measure": measure, "idle": idle}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
