#!/usr/bin/env python3
"""tests/monitor_page64.py - the monitor's page (src/monitor_page.html) with 64
ranks, rendered by headless Chromium: it must stay readable, showing a median
row and the ranks that matter (rank 0, the slowest, the straggler, a silent
rank, a dead one, the six slowest) instead of 64 rows, and say how many it left
out.  The state is made here (the shape /api/state has), served with the page
by a local HTTP server; no job runs.  Prints "monitor page check: ..." and
exits 1 on a failure.
"""
import http.server
import json
import random
import re
import subprocess
import sys
import threading

PAGE = open("src/monitor_page.html", encoding="utf-8").read()
random.seed(7)
PHASES = ["data", "forward", "backward", "comm_wait", "optimizer", "idle"]


def rank(r):
    step = 20 + random.uniform(-1, 1) + (40 if r == 37 else 0)
    ph = {"data": 0.5, "forward": 6, "backward": 7, "comm_wait": step - 16.5, "optimizer": 1,
          "idle": 2}
    status = "silent" if r == 50 else "died" if r == 12 else "up"
    return {"rank": r, "pid": 1000 + r, "status": status, "steps": 500 - (r == 50) * 40,
            "last_seen_s": 9 if status != "up" else 0.2, "step_ms": step, "phases_ms": ph,
            "samples_per_s": 128 / step * 1e3, "bytes_per_s": 2e8, "busbw_GBps": 0.8,
            "straggler": r == 37, "ps_calls": 0, "ps_latency_ms": None, "ps_max_staleness": 0,
            "ps_mean_staleness": 0, "scalars": {"loss": 0.4},
            "doing": DOING if r == 37 else "computing", "warnings": 0, "warning": ""}


DOING = "waiting for its data loader for 25 s"
CPU_WHY = "rank 50 got 52% of the CPU its threads were ready to use"
LOADER_WHY = "rank 37's data loader holds the job back"


STATE = {"world": 64, "interval_s": 1, "uptime_s": 60, "slowest": 37,
         "why": "slowest rank: 37, busy 58.00 ms of its 60.00 ms step", "straggler": 37,
         "slow_server": -1, "server_why": "", "cpu_starved": 50, "cpu_why": CPU_WHY,
         "loader_bottleneck": 37, "loader_why": LOADER_WHY, "ranks": [rank(r) for r in range(64)],
         "history": [{"t": t, "steps": t * 8, "samples_per_s": 300000, "step_ms": 20,
                      "loss": 1 / (t + 1), "val_loss": None, "lr": None,
                      **{p: 3 for p in PHASES}} for t in range(60)]}


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        path = self.path.split("?")[0]
        body, ctype = (PAGE, "text/html") if path == "/" else \
                      (json.dumps(STATE), "application/json") if path == "/api/state" else ("", "")
        self.send_response(200 if ctype else 404)
        self.send_header("Content-Type", ctype or "text/plain")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=srv.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{srv.server_address[1]}/?poll=500"
dom = subprocess.run(["chromium", "--headless", "--disable-gpu", "--no-sandbox",
                      "--virtual-time-budget=2000", "--dump-dom", url],
                     capture_output=True, text=True, timeout=60).stdout
srv.shutdown()
rows = re.findall(r'<tr data-rank="([0-9a-z]+)"', dom)
want = {"median", "0", "37", "50", "12"}
if not want <= set(rows):
    sys.exit(f"monitor page check: FAILED: rows {rows}, expected {sorted(want)} among them")
if len(rows) > 16:
    sys.exit(f"monitor page check: FAILED: {len(rows)} rows for 64 ranks")
m = re.search(r"([0-9]+) more ranks near the median are not shown", dom)
if not m or int(m.group(1)) != 64 - (len(rows) - 1):
    sys.exit(f"monitor page check: FAILED: the page does not say how many ranks it left out")
for r, cls in (("50", "silent"), ("12", "died")):
    if not re.search(rf'<tr data-rank="{r}"[^>]*>.*?<td class="l {cls}">', dom):
        sys.exit(f"monitor page check: FAILED: rank {r} is not shown as {cls}")
if not re.search(rf'<tr data-rank="37"[^>]*>.*?{DOING}', dom):
    sys.exit("monitor page check: FAILED: rank 37's row does not say what it is doing")
for what in (CPU_WHY, LOADER_WHY):
    if what.replace("'", "&#39;") not in dom and what not in dom:
        sys.exit(f"monitor page check: FAILED: the diagnosis lacks '{what}'")
print(f"monitor page check: 64 ranks in {len(rows)} rows (a median row, rank 0, the slowest and "
      f"straggler 37, silent 50, dead 12, the slowest others); {m.group(1)} left out, as it says; "
      f"rank 37's activity, the cpu and loader verdicts shown")
