#!/usr/bin/env bash
# Issue 28's load generator benchmark on a lent machine's cores (no GPU needed), from the root of
# the checkout that travelled, with scripts/peers-bundle.sh's folder carried as .peers-bundle:
#   bash scripts/loadgen-remote.sh [load_generator.py flags]          # in this call
#   bash scripts/loadgen-remote.sh detach [flags]; bash scripts/loadgen-remote.sh wait SECONDS
#     (the run outlives a call; `wait` returns its exit code, or 124 while it still runs)
#   weak scaling (each worker keeps 16 streams, C = 16 x cores): detach --peers none --streams-a-core 16
# Timed part: one fake server on core 0, every client on core 1 (as on the CPU VM). Raw part: three
# zero-delay fake servers on cores 0-2 sharing the port, 64 token events a write; core 3 for the
# process that drives a client's workers; each client (lanebench and each peer) on 1, 2, 4, 8 and
# 12 of cores 4-15 with as many worker processes. The whole output goes to $OUT/loadgen.md and
# the exit code is the benchmark's (non-zero on any error: a peer that fails, a request lost, a
# script that breaks).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
R=/tmp/loadgen-run  # survives between calls while the machine stays warm
mkdir -p "$OUT" "$R"
case "${1:-}" in
detach)
  # From a copy of the checkout: each later call (`wait`) re-sends the working tree over this one,
  # and a worker process started mid-copy failed its imports (2026-12-08, the 12-core row lost).
  shift; rm -rf "$R/done" "$R/loadgen.md" "$R/tree"; cp -a . "$R/tree"
  (cd "$R/tree" && setsid nohup bash scripts/loadgen-remote.sh "$@" > "$R/remote.log" 2>&1 < /dev/null &)
  echo "loadgen-remote: detached, from $R/tree"; exit 0 ;;
wait)
  limit=${2:-540}; start=$SECONDS
  while [ ! -f "$R/done" ] && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 5; done
  cp "$R"/*.md "$R"/*.txt "$OUT"/ 2>/dev/null; tail -5 "$R/remote.log"
  [ -f "$R/done" ] || { echo "loadgen-remote: still running after ${limit}s"; exit 124; }
  exit "$(cat "$R/done")" ;;
esac
mkdir -p /tmp/peers
tar -xJf .peers-bundle/peers.tar.xz -C /tmp/peers || { echo "loadgen-remote: no peers bundle" >&2; echo 1 > "$R/done"; exit 1; }
{ nproc; uname -r; python3 --version; cat /proc/loadavg; } > "$R/machine.txt" 2>&1
cores=$(nproc)
last=$((cores - 1))
export PYTHONPATH="/tmp/peers/lanebench:$PWD" LANEBENCH_PEERS_SITE=/tmp/peers PYTHONUNBUFFERED=1 DO_NOT_TRACK=1
python3 benchmarks/load_generator.py --server-cpu 0 --client-cpu 1 --raw-server-cpus 0,1,2 --parent-cpu 3 --events-per-write 64 \
  --client-cpus "$(seq -s, 4 "$last")" --workers "${WORKERS:-1,2,4,8,12}" "$@" 2>&1 | tee "$R/loadgen.md"
rc=${PIPESTATUS[0]}
echo "loadgen-remote: benchmark exit code $rc" | tee -a "$R/loadgen.md"
cp "$R"/*.md "$R"/*.txt "$OUT"/ 2>/dev/null
echo "$rc" > "$R/done"
exit "$rc"
