#!/usr/bin/env bash
# Render a Chrome trace-event JSON (dtrain's profiler output) to a PNG with
# headless Chromium, fully offline.
#
#   tests/bench/render_trace.sh [options] TRACE.json OUT.png
#
# Viewers:
#   timeline   (default) tests/bench/trace_view.html: every rank x thread as
#              a row on one time axis, colored by event name, with a legend of
#              total time per name.
#   speedscope speedscope's static build (npm package `speedscope`, fetched
#              into tests/bench/build/trace_viewer/ on first use).  Shows ONE
#              (pid,tid) at a time as a time-ordered flame chart; pick which
#              with --profile N (0-based, in pid then tid order).
# Options:
#   --viewer timeline|speedscope
#   --size W[xH]        window size in CSS pixels (default 1600; the timeline
#                       viewer picks the height to fit the rows when H is left
#                       out; speedscope defaults to 900)
#   --scale S           device pixel ratio, e.g. 2 for a sharper PNG (default 1)
#   --range A:B         timeline only: show A..B ms after the first event
#   --title TEXT        timeline only: title (default: trace file name)
#   --profile N         speedscope only: which (pid,tid) to show (default 0)
# Needs: Debian `chromium` (installed with apt-get when missing and run as
# root), and for speedscope `node`/`npm`.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SPEEDSCOPE_VERSION="${SPEEDSCOPE_VERSION:-1.25.0}"
VIEWER=timeline SIZE=1600 SCALE=1 RANGE='' TITLE='' PROFILE=0
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --viewer) VIEWER="$2"; shift 2 ;;
    --size) SIZE="$2"; shift 2 ;;
    --scale) SCALE="$2"; shift 2 ;;
    --range) RANGE="$2"; shift 2 ;;
    --title) TITLE="$2"; shift 2 ;;
    --profile) PROFILE="$2"; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "render_trace: unknown option $1" >&2; exit 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[ ${#ARGS[@]} -eq 2 ] || { echo "usage: $0 [options] TRACE.json OUT.png  (--help)" >&2; exit 2; }
TRACE="$(realpath "${ARGS[0]}")"
OUT="$(realpath -m "${ARGS[1]}")"
[ -f "$TRACE" ] || { echo "render_trace: no such file: ${ARGS[0]}" >&2; exit 2; }
[[ "$SIZE" =~ ^[0-9]+(x[0-9]+)?$ ]] || { echo "render_trace: --size wants W or WxH" >&2; exit 2; }

# --- browser -----------------------------------------------------------------
CHROME="${CHROME:-}"
if [ -z "$CHROME" ]; then
  for c in chromium chromium-browser google-chrome chrome-headless-shell; do
    if command -v "$c" >/dev/null 2>&1; then CHROME="$(command -v "$c")"; break; fi
  done
fi
if [ -z "$CHROME" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "render_trace: installing chromium (apt-get)" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
    CHROME="$(command -v chromium)"
  else
    echo "render_trace: no chromium found; install it: sudo apt-get install chromium" >&2
    exit 1
  fi
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/render_trace.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

urlenc() { node -e 'process.stdout.write(encodeURIComponent(process.argv[1]))' "$1" 2>/dev/null ||
           python3 -c 'import sys,urllib.parse;print(urllib.parse.quote(sys.argv[1],safe=""),end="")' "$1"; }

case "$VIEWER" in
timeline)
  # The page loads the trace as a script (file:// pages may not fetch() files).
  { printf 'window.TRACE_DATA='; cat "$TRACE"; printf ';\n'; } > "$WORK/trace.js"
  cp "$HERE/trace_view.html" "$WORK/view.html"
  HASH="data=$(urlenc "$WORK/trace.js")&title=$(urlenc "${TITLE:-$(basename "$TRACE")}")"
  if [ -n "$RANGE" ]; then HASH="$HASH&start=${RANGE%%:*}&end=${RANGE##*:}"; fi
  URL="file://$WORK/view.html#$HASH"
  ;;
speedscope)
  command -v node >/dev/null || { echo "render_trace: speedscope needs node/npm" >&2; exit 1; }
  SS="$HERE/build/trace_viewer/speedscope-$SPEEDSCOPE_VERSION"
  if [ ! -f "$SS/dist/release/index.html" ]; then
    echo "render_trace: fetching speedscope@$SPEEDSCOPE_VERSION from npm into $SS" >&2
    mkdir -p "$SS.tmp"
    (cd "$SS.tmp" && npm pack --silent "speedscope@$SPEEDSCOPE_VERSION" >/dev/null 2>&1 &&
       tar xzf speedscope-*.tgz --strip-components=1 && rm -f speedscope-*.tgz)
    rm -rf "$SS"; mv "$SS.tmp" "$SS"
  fi
  # speedscope's Chrome importer turns X events into B/E pairs and gives up on
  # spans that partially overlap -- even by float rounding, as it shifts all ts
  # by the first one -- and it keys frames by name+args.  Hand it a cleaned
  # copy: args dropped, begin/end snapped to whole microseconds, each span
  # clipped to end no later than a following sibling starts.
  node - "$TRACE" "$PROFILE" > "$WORK/profile.js" <<'EOF'
const fs = require("fs");
const [trace, profile] = process.argv.slice(2);
let t = JSON.parse(fs.readFileSync(trace, "utf8"));
if (Array.isArray(t)) t = { traceEvents: t };
const byThread = new Map();
for (const e of t.traceEvents) {
  if (e.ph !== "X") continue;
  delete e.args;
  const b = Math.round(+e.ts), end = Math.round(+e.ts + +(e.dur || 0));
  e.ts = b; e.dur = end - b;
  const k = e.pid + ":" + e.tid;
  if (!byThread.has(k)) byThread.set(k, []);
  byThread.get(k).push(e);
}
for (const evs of byThread.values()) {
  evs.sort((a, b) => a.ts - b.ts || b.dur - a.dur);
  const stack = [];
  for (const e of evs) {
    while (stack.length && stack[stack.length - 1].ts + stack[stack.length - 1].dur <= e.ts) stack.pop();
    const top = stack[stack.length - 1];
    if (top && e.ts + e.dur > top.ts + top.dur) {      // sticks out of its parent
      if (e.ts - top.ts < 1) top.dur = e.ts - top.ts;   // touching: siblings, end the earlier one
      else e.dur = top.ts + top.dur - e.ts;             // nested: clip to the parent
      if (top.dur <= e.ts - top.ts) stack.pop();
    }
    stack.push(e);
  }
}
const b64 = Buffer.from(JSON.stringify(t)).toString("base64");
process.stdout.write(`speedscope.loadFileFromBase64("trace.json", ${JSON.stringify(b64)});\n` +
  // Step to profile N with the viewer's own "n" key, one press at a time.
  `for (let i = 0; i < ${+profile || 0}; i++) setTimeout(() =>\n` +
  `  window.dispatchEvent(new KeyboardEvent("keypress", {key: "n"})), 500 + 200 * i);\n`);
EOF
  URL="file://$SS/dist/release/index.html#localProfilePath=$WORK/profile.js"
  ;;
*) echo "render_trace: unknown viewer $VIEWER" >&2; exit 2 ;;
esac

CHROME_FLAGS=(--headless --no-sandbox --disable-gpu --hide-scrollbars
  --no-first-run --no-default-browser-check --user-data-dir="$WORK/profile"
  --allow-file-access-from-files --enable-unsafe-swiftshader --virtual-time-budget=5000)
start=$(date +%s.%N)
if [ "$VIEWER" = timeline ]; then
  # Check pass: lay the page out once and read back the height that fits the
  # rows (used when --size gives no height); no height means it failed.
  "$CHROME" "${CHROME_FLAGS[@]}" --window-size="${SIZE%x*},900" --dump-dom "$URL&w=${SIZE%x*}&h=900" \
      >"$WORK/dom.html" 2>"$WORK/chrome.log" || true
  N=$(sed -n 's/.*data-natural-height="\([0-9]*\)".*/\1/p' "$WORK/dom.html" | head -1)
  if [ -z "$N" ]; then
    echo "render_trace: the viewer could not render $TRACE:" >&2
    E=$(sed -n 's/.*data-error="\([^"]*\)".*/\1/p' "$WORK/dom.html" | head -1)
    echo "  ${E:-no output from chromium; its log:}" >&2
    [ -n "$E" ] || tail -20 "$WORK/chrome.log" >&2
    exit 1
  fi
  [ "$N" -lt 200 ] && N=200; [ "$N" -gt 8000 ] && N=8000
  [[ "$SIZE" == *x* ]] || SIZE="${SIZE}x$N"
fi
[[ "$SIZE" == *x* ]] || SIZE="${SIZE}x900"
[ "$VIEWER" = timeline ] && URL="$URL&w=${SIZE%x*}&h=${SIZE#*x}"
mkdir -p "$(dirname "$OUT")"
rm -f "$OUT"
# --virtual-time-budget lets the page's scripts and timers finish before the shot.
if ! "$CHROME" "${CHROME_FLAGS[@]}" --window-size="${SIZE/x/,}" --force-device-scale-factor="$SCALE" \
      --screenshot="$OUT" "$URL" >"$WORK/chrome.log" 2>&1 || [ ! -s "$OUT" ]; then
  echo "render_trace: chromium failed; its log:" >&2
  tail -20 "$WORK/chrome.log" >&2
  exit 1
fi
awk -v a="$start" -v b="$(date +%s.%N)" -v o="$OUT" -v v="$VIEWER" \
  'BEGIN { printf "render_trace: wrote %s (%s viewer, %.1f s)\n", o, v, b - a }' >&2
