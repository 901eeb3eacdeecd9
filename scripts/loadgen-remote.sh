#!/usr/bin/env bash
# Issue 28's load generator benchmark on a lent machine's cores (no GPU needed), from the root of
# the checkout that travelled, with scripts/peers-bundle.sh's folder carried as .peers-bundle:
#   bash scripts/loadgen-remote.sh
# Timed part: one fake server on core 0, every client on core 1 (as on the CPU VM). Raw part: four
# zero-delay fake servers on cores 0-3 sharing the port, lanebench over 1, 2, 4, 8 and 12 worker
# processes pinned to cores 4-15, and each peer given the same 12 cores for its own workers.
# The whole output goes to $OUT/loadgen.md and the exit code is the benchmark's (non-zero on any
# error: a peer that fails, a request lost, a script that breaks).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /tmp/peers
tar -xJf .peers-bundle/peers.tar.xz -C /tmp/peers || { echo "loadgen-remote: no peers bundle" >&2; exit 1; }
{ nproc; uname -r; python3 --version; cat /proc/loadavg; } > "$OUT/machine.txt" 2>&1
cores=$(nproc)
last=$((cores - 1))
export PYTHONPATH="/tmp/peers/lanebench:$PWD" LANEBENCH_PEERS_SITE=/tmp/peers PYTHONUNBUFFERED=1 DO_NOT_TRACK=1
python3 benchmarks/load_generator.py --server-cpu 0 --client-cpu 1 --raw-server-cpus 0,1,2,3 \
  --client-cpus "$(seq -s, 4 "$last")" --workers "${WORKERS:-1,2,4,8,12}" "$@" 2>&1 | tee "$OUT/loadgen.md"
rc=${PIPESTATUS[0]}
echo "loadgen-remote: benchmark exit code $rc" | tee -a "$OUT/loadgen.md"
exit "$rc"
