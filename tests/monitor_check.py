#!/usr/bin/env python3
"""tests/monitor_check.py PORT WORLD [TOKEN | --silent RANK | --zero] - what a running job's monitor
serves (src/monitor.c), checked from outside as a user's tools see it:

  /metrics    parsed by prometheus_client's own text-format parser: every
              family dtrain documents is there with its type and help, every
              sample has a rank label in 0..WORLD-1 (phases their phase),
              and every rank is up
  /api/state  JSON: WORLD ranks, all up, steps rising between two reads
  /events     a Server-Sent Event whose data is the state
  bad input   a request line that is not HTTP, a 20 KiB header, a POST, an
              unknown path each get an error status; training goes on
  TOKEN       (the server is off loopback) no token: 401; the token: 200
  --silent R  (rank R was stopped) only that: R is "silent" and down
  --zero      (a sharded DDP, zero 3) also: every rank's parameter gathers
              in /metrics and /api/state, rising, the exposed part no more
              than the whole

Prints "monitor check: ..." lines; exits 1 on the first failure.
"""
import json
import socket
import sys
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PORT, WORLD = int(sys.argv[1]), int(sys.argv[2])
SILENT = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--silent" else None
ZERO = len(sys.argv) > 3 and sys.argv[3] == "--zero"
TOKEN = sys.argv[3] if len(sys.argv) > 3 and SILENT is None and not ZERO else None
BASE = f"http://127.0.0.1:{PORT}"
FAMILIES = {   # name (as the parser gives it: counters without _total) -> type
    "dtrain_world_size": "gauge", "dtrain_up": "gauge", "dtrain_last_seen_seconds": "gauge",
    "dtrain_steps": "counter", "dtrain_step_seconds": "counter",
    "dtrain_step_phase_seconds": "counter", "dtrain_samples": "counter",
    "dtrain_samples_per_second": "gauge", "dtrain_collective_bytes": "counter",
    "dtrain_collectives": "counter", "dtrain_collective_bus_bandwidth_bytes_per_second": "gauge",
    "dtrain_communication_seconds": "counter", "dtrain_exposed_communication_seconds": "counter",
    "dtrain_straggler": "gauge", "dtrain_ps_requests": "counter",
    "dtrain_ps_latency_seconds": "counter", "dtrain_ps_staleness_max": "gauge",
    "dtrain_ps_staleness_mean": "gauge", "dtrain_loss": "gauge", "dtrain_learning_rate": "gauge",
    "dtrain_validation_loss": "gauge", "dtrain_metric": "gauge",
    "dtrain_ps_server_seconds": "counter", "dtrain_ps_server_busy_seconds": "counter",
    "dtrain_ps_server_stalled_seconds": "counter", "dtrain_ps_server_requests": "counter",
    "dtrain_ps_server_received_bytes": "counter", "dtrain_ps_server_sent_bytes": "counter",
    "dtrain_ps_server_queue_max": "gauge", "dtrain_ps_server_keys": "gauge",
    "dtrain_parameter_gather_seconds": "counter",
    "dtrain_parameter_gather_exposed_seconds": "counter", "dtrain_warnings": "counter",
    "dtrain_cpu_seconds": "counter", "dtrain_cpu_wait_seconds": "counter",
    "dtrain_cpu_throttled_seconds": "counter",
}
PHASES = {"data", "forward", "backward", "comm_wait", "optimizer", "idle"}


def fail(msg):
    print(f"monitor check: FAILED: {msg}")
    sys.exit(1)


def get(path, token=TOKEN):
    url = BASE + path + (f"?token={token}" if token else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def raw(request):
    """Send bytes as they are; the status code of the answer (0: closed)."""
    with socket.create_connection(("127.0.0.1", PORT), timeout=10) as s:
        s.sendall(request)
        data = b""
        try:
            while b"\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass
    line = data.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


def check_metrics():
    status, ctype, text = get("/metrics")
    if status != 200 or not ctype.startswith("text/plain; version=0.0.4"):
        fail(f"/metrics: {status} {ctype}")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, typ in FAMILIES.items():
        if name not in fams:
            fail(f"/metrics has no family {name}")
        if fams[name].type != typ or not fams[name].documentation:
            fail(f"{name}: type {fams[name].type}, help '{fams[name].documentation}'")
    for f in fams.values():
        if f.name not in FAMILIES:
            fail(f"an undocumented family {f.name}")
        for s in f.samples:
            if f.name == "dtrain_world_size":
                if s.value != WORLD:
                    fail(f"dtrain_world_size {s.value}")
                continue
            if s.labels.get("rank") not in {str(r) for r in range(WORLD)}:
                fail(f"{s.name} {s.labels}: no rank label in 0..{WORLD - 1}")
            extra = set(s.labels) - {"rank"}
            want = {"phase"} if f.name == "dtrain_step_phase_seconds" else \
                   {"name"} if f.name == "dtrain_metric" else set()
            if extra != want:
                fail(f"{s.name} {s.labels}: labels {extra}, expected {want}")
            if "phase" in s.labels and s.labels["phase"] not in PHASES:
                fail(f"{s.name}: phase {s.labels['phase']}")
    up = {s.labels["rank"]: s.value for s in fams["dtrain_up"].samples}
    if sorted(up) != [str(r) for r in range(WORLD)] or any(v != 1 for v in up.values()):
        fail(f"dtrain_up {up}")
    phases = {(s.labels["rank"], s.labels["phase"]) for s in fams["dtrain_step_phase_seconds"].samples}
    if len(phases) != WORLD * len(PHASES):
        fail(f"phases {sorted(phases)}")
    n = sum(len(f.samples) for f in fams.values())
    print(f"monitor check: /metrics: {len(fams)} families, {n} samples, all parsed by "
          f"prometheus_client, every rank labelled and up")


def state():
    status, ctype, text = get("/api/state")
    if status != 200 or ctype != "application/json":
        fail(f"/api/state: {status} {ctype}")
    s = json.loads(text)
    if s["world"] != WORLD or [r["rank"] for r in s["ranks"]] != list(range(WORLD)):
        fail(f"/api/state ranks: {[r['rank'] for r in s['ranks']]}")
    if any(r["status"] != "up" for r in s["ranks"]):
        fail(f"/api/state: not all up: {[r['status'] for r in s['ranks']]}")
    return s


def check_state():
    a = state()
    time.sleep(2.5)
    b = state()
    sa, sb = [r["steps"] for r in a["ranks"]], [r["steps"] for r in b["ranks"]]
    if not all(y > x for x, y in zip(sa, sb)):
        fail(f"steps did not rise: {sa} -> {sb}")
    if not b["history"] or "why" not in b or b["slowest"] not in range(-1, WORLD):
        fail("/api/state: no history or diagnosis")
    print(f"monitor check: /api/state: {WORLD} ranks up, steps {sa} -> {sb} in 2.5 s; "
          f"\"{b['why']}\"")
    return b


def check_events():
    url = BASE + "/events" + (f"?token={TOKEN}" if TOKEN else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        if r.headers.get("Content-Type") != "text/event-stream":
            fail(f"/events: {r.headers.get('Content-Type')}")
        for _ in range(50):
            line = r.readline().decode()
            if line.startswith("data: "):
                s = json.loads(line[6:])
                if s["world"] != WORLD or len(s["history"]) > 1:
                    fail("/events: not the live state")
                print(f"monitor check: /events: an event of {len(line)} bytes with the state")
                return
    fail("/events: no data line")


def check_bad_requests():
    codes = {
        "not HTTP": raw(b"HELLO THERE\r\n\r\n"),
        "a 20 KiB header": raw(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20480 +
                               b"\r\n\r\n"),
        "a POST": raw(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"),
        "an unknown path": raw(b"GET /nope" + (f"?token={TOKEN}".encode() if TOKEN else b"") +
                               b" HTTP/1.1\r\nHost: x\r\n\r\n"),
    }
    want = {"not HTTP": range(400, 600), "a 20 KiB header": range(400, 600),
            "a POST": [405], "an unknown path": [404]}
    for what, code in codes.items():
        if code not in want[what]:
            fail(f"{what}: status {code}")
    print("monitor check: refused: " + ", ".join(f"{w} ({c})" for w, c in codes.items()))


def check_token():
    try:
        get("/api/state", token=None)
        fail("off loopback, a request without the token was answered")
    except urllib.error.HTTPError as e:
        if e.code != 401:
            fail(f"without the token: {e.code}")
    try:
        get("/api/state", token=TOKEN + "x")
        fail("a wrong token was accepted")
    except urllib.error.HTTPError as e:
        if e.code != 401:
            fail(f"a wrong token: {e.code}")
    print("monitor check: off loopback: no token 401, a wrong one 401, the job's 200")


def gathers():
    """{rank: (gather s, exposed s)} from /metrics, and the same from /api/state"""
    fams = {f.name: f for f in text_string_to_metric_families(get("/metrics")[2])}
    g = {x.labels["rank"]: x.value for x in fams["dtrain_parameter_gather_seconds"].samples}
    e = {x.labels["rank"]: x.value for x in fams["dtrain_parameter_gather_exposed_seconds"].samples}
    st = {str(r["rank"]): (r["gather_s"], r["gather_exposed_s"]) for r in state()["ranks"]}
    return {r: (g[r], e.get(r)) for r in g}, st


def check_zero():
    a, sa = gathers()
    time.sleep(2.5)
    b, sb = gathers()
    ranks = [str(r) for r in range(WORLD)]
    if sorted(b) != ranks or sorted(sb) != ranks:
        fail(f"parameter gathers: ranks {sorted(b)} in /metrics, {sorted(sb)} in /api/state")
    for r in ranks:
        if not (b[r][0] > a.get(r, (0, 0))[0] > 0) or not (0 <= b[r][1] <= b[r][0]):
            fail(f"rank {r}: parameter gathers {a.get(r)} -> {b[r]} (seconds, exposed)")
        if not (sb[r][0] is not None and sb[r][0] > 0):
            fail(f"rank {r}: /api/state gather_s {sb[r]}")
    print("monitor check: zero 3: parameter gathers rising on every rank: " +
          ", ".join(f"rank {r} {b[r][0]:.2f} s ({b[r][1]:.2f} exposed)" for r in ranks))


def check_silent(rank):
    s = json.loads(get("/api/state")[2])
    status = {r["rank"]: r["status"] for r in s["ranks"]}
    up = {x.labels["rank"]: x.value for f in text_string_to_metric_families(get("/metrics")[2])
          if f.name == "dtrain_up" for x in f.samples}
    if status[rank] != "silent" or up[str(rank)] != 0:
        fail(f"rank {rank} stopped: status {status[rank]}, dtrain_up {up[str(rank)]}")
    if any(status[r] != "up" or up[str(r)] != 1 for r in status if r != rank):
        fail(f"the others: {status}, {up}")
    print(f"monitor check: rank {rank} stopped: 'silent' on the page, dtrain_up 0; the others up")
    sys.exit(0)


if SILENT is not None:
    check_silent(SILENT)
if TOKEN:
    check_token()
check_metrics()
if ZERO:
    check_zero()
before = check_state()
check_events()
check_bad_requests()
time.sleep(2.5)   # a new summary from every rank
after = state()
if not all(y > x for x, y in zip([r["steps"] for r in before["ranks"]],
                                 [r["steps"] for r in after["ranks"]])):
    fail("training stopped after the bad requests")
print("monitor check: training went on after them")
