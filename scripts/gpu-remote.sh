#!/usr/bin/env bash
# What runs on the lent GPU machine (scripts/gpu-run.sh prepares the bundle; docs/gpu.md).
# From the root of the checkout that travelled, with the bundle at .gpu-bundle:
#   bash .gpu-bundle/gpu-remote.sh PHASE...         PHASE: client build facts models fixtures nightly matrix kl, or all
#   bash .gpu-bundle/gpu-remote.sh detach PHASE...  the same, in its own session (it outlives the call)
#   bash .gpu-bundle/gpu-remote.sh wait SECONDS     wait for a detached run, then pack and exit with its code
# Each phase's exit code and seconds go to evidence/phases.tsv; the script exits non-zero when any
# phase failed or did not run, so a failing night cannot come back as a success. Everything lands
# in $OUT/results.tar.gz (run folders, evidence, fixtures, logs, phases.tsv).
set -uo pipefail

start=$SECONDS
B="$PWD/.gpu-bundle"
W=/tmp/lb                               # the code, unpacked fresh each run
DEPS=/tmp/lbdeps                        # site-packages, kept while the machine stays warm
R=/tmp/lbresults                        # what comes back, accumulated across calls
OUT="${OUT:-/tmp/out}"
mkdir -p "$R/evidence" "$R/fixtures" "$R/art" "$OUT"
log() { echo "[gpu-remote $((SECONDS - start))s] $*"; }
pack() {
  cp "$B/gpu-remote.sh" "$R/evidence/gpu-remote.sh" 2>/dev/null
  tar -C "$R" -czf "$OUT/results.tar.gz" . && log "packed $(du -h "$OUT/results.tar.gz" | cut -f1)"
}

case "${1:-}" in
detach)  # the run in its own session: the call may end, the run goes on until the machine goes back
  shift
  rm -f "$R/done"
  setsid nohup bash "$B/gpu-remote.sh" "$@" > "$R/evidence/remote.log" 2>&1 < /dev/null &
  log "detached: pid $!"; exit 0 ;;
wait)  # the detached run's end: its own exit code, or 124 when it is still running
  limit=${2:-540}
  while [ ! -f "$R/done" ] && [ $((SECONDS - start)) -lt "$limit" ]; do sleep 5; done
  cat "$R/evidence/remote.log" 2>/dev/null | grep '^\[gpu-remote' || true
  pack
  [ -f "$R/done" ] || { log "still running after ${limit}s"; exit 124; }
  rc=$(cat "$R/done"); log "detached run ended: rc=$rc"; exit "$rc" ;;
esac

phases=("$@"); [ "${phases[*]:-all}" = all ] && phases=(build facts models fixtures nightly)
: > "$R/evidence/phases.tsv.new"; [ -f "$R/evidence/phases.tsv" ] && cat "$R/evidence/phases.tsv" > "$R/evidence/phases.tsv.new"
mv "$R/evidence/phases.tsv.new" "$R/evidence/phases.tsv"
failed=0
finish() { rc=$?; [ "$failed" -ne 0 ] && rc=1; echo "$rc" > "$R/done"; pack; }
trap finish EXIT
record() {  # phase, rc, seconds: one line per phase, and the run fails with any phase
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$R/evidence/phases.tsv"
  [ "$2" -eq 0 ] || failed=1
  log "phase $1: rc=$2 in $3 s"
}

unzip_wheels() {  # the GGUF writer and any package the lock gained after site.tar.xz was made
  local w; for w in "$B"/gguf-*.whl "$B"/extra-*.whl; do
    [ ! -f "$w" ] || python3 -m zipfile -e "$w" "$DEPS/gpusite" || return 1
  done
}

# REHEARSAL=1: a dry run on a CPU machine whose python3 already has the dependencies.
if [ "${REHEARSAL:-0}" = 1 ]; then backend=cpu; else backend=cuda; fi
if [ "${REHEARSAL:-0}" != 1 ] && [ ! -d "$DEPS/gpusite" ]; then
  mkdir -p "$DEPS" && tar -xJf "$B/site.tar.xz" -C "$DEPS" \
    && unzip_wheels && log "dependencies unpacked" \
    || { record unpack 1 0; exit 1; }
fi
rm -rf "$W" && mkdir -p "$W" && tar -xzf "$B/code.tar.gz" -C "$W"
mkdir -p "$W/testbed/models" && cp testbed/models/*.gguf "$W/testbed/models/"        # the checkout that travelled holds them
[ -d /tmp/llama-src ] || tar -xJf "$B/llama-src.tar.xz" -C /tmp
export PYTHONPATH="$DEPS/gpusite:$W" PYTHONUNBUFFERED=1 DO_NOT_TRACK=1 PREFECT_HOME=/tmp/prefect \
  LANEBENCH_CACHE=/tmp/lbcache LANEBENCH_LLAMA_BACKEND=$backend LANEBENCH_CUDA_ARCHS=90 LANEBENCH_LLAMA_SRC=/tmp/llama-src
cd "$W"
lanebench() { python3 -c 'import sys; from flows.cli import main; sys.exit(main())' "$@"; }
smi() { nvidia-smi --query-gpu="$(python3 -c 'from tasks.hosts.gpu import QUERY; print(QUERY)')" --format=csv,noheader,nounits; }
apps() { nvidia-smi --query-compute-apps="$(python3 -c 'from tasks.hosts.gpu import APPS; print(APPS)')" --format=csv,noheader,nounits; }
M=/tmp/lbmodels; mkdir -p "$M"
# The big models, generated here from a seed (never carried): an ~8 B Llama-8B-like body, its
# F16 and Q4_K_M files, and its own first 2 layers as a drafter. Residual scale 3e-5: every depth
# predicts nearly what the embedding does, so the drafter is accepted almost always (a best case
# for speculation; the bytes the GPU reads per step are an 8 B model's either way).
BIG=(--width 4096 --seed 23 --residual-scale 3e-5)

phase_build() {
  { nproc; uname -r; nvcc --version | tail -2; cmake --version | head -1; python3 --version; } > "$R/evidence/machine.txt" 2>&1
  local bin; bin="$(bash scripts/build-llama-cpp.sh)" || return $?
  cp /tmp/lbcache/llama.cpp/*.log "$R/evidence/" 2>/dev/null
  cat "$(dirname "$bin")/SOURCE" > "$R/evidence/cuda-build.txt"; echo "bin=$bin" >> "$R/evidence/cuda-build.txt"
}
phase_facts() {
  smi > "$R/fixtures/nvidia-smi-query-idle.csv" && apps > "$R/fixtures/nvidia-smi-apps-idle.csv" \
    && nvidia-smi > "$R/fixtures/nvidia-smi-banner.txt" && nvidia-smi -q > "$R/evidence/nvidia-smi-q.txt" || return $?
  # The memory-bandwidth ceiling, measured: a device-to-device copy of 4 GiB (bytes read + written).
  env -u PYTHONPATH python3 - > "$R/evidence/bandwidth.json" <<'EOF'
import json, torch
x = torch.empty(1 << 31, dtype=torch.float16, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(20): y.copy_(x)
e.record(); torch.cuda.synchronize(); sec = s.elapsed_time(e) / 1e3 / 20
print(json.dumps({"copy_bytes": 2 * x.numel() * 2, "seconds": sec, "gbps_read_plus_write": 2 * x.numel() * 2 / sec / 1e9,
                  "device": torch.cuda.get_device_name(0)}))
EOF
}
phase_models() {
  local bin; bin="$(bash scripts/build-llama-cpp.sh)" || return $?
  python3 testbed/random_model.py --params 1.5e9 --out /tmp/lanebench-random-f16.gguf || return $?
  python3 testbed/random_model.py "${BIG[@]}" --params 8e9 --out "$M/random-8b-f16.gguf" || return $?
  python3 testbed/random_model.py "${BIG[@]}" --layers 2 --out "$M/random-8b-draft2l-f16.gguf" || return $?
  "$bin/llama-quantize" "$M/random-8b-f16.gguf" "$M/random-8b-q4_k_m.gguf" Q4_K_M "$(nproc)" \
    > "$R/evidence/quantize.log" 2>&1 || return $?
  ls -l "$M" /tmp/lanebench-random-f16.gguf
}
phase_fixtures() {
  # A CUDA llama-server with the testbed target and drafter, as the testbed-gpu lane boots it:
  # its boot log, /props, /slots, /metrics and streams become CI's fixtures.
  local bin f="$R/fixtures" pid rc; bin="$(bash scripts/build-llama-cpp.sh)" || return $?
  "$bin/llama-server" --model testbed/models/target-f16.gguf --host 127.0.0.1 --port 18399 --parallel 2 \
    --ctx-size 1024 --metrics --no-webui --model-draft testbed/models/drafter-good-f16.gguf \
    --spec-type draft-simple --spec-draft-n-max 4 --spec-draft-n-min 0 --spec-draft-p-min 0.0 \
    --n-gpu-layers all --n-gpu-layers-draft all > "$f/boot.log" 2>&1 &
  pid=$!
  timeout 120 python3 - "$f" <<'EOF'
import sys, time, pathlib, httpx
f, base = pathlib.Path(sys.argv[1]), "http://127.0.0.1:18399"
while True:
    try:
        if httpx.get(base + "/health", timeout=2).status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(0.2)
(f / "props.json").write_text(httpx.get(base + "/props").text)
(f / "slots_boot.json").write_text(httpx.get(base + "/slots").text)
(f / "metrics_before.prom").write_text(httpx.get(base + "/metrics").text)
for name, n in (("stream_length.sse", 48), ("stream_stop.sse", 400)):
    body = {"prompt": "The river town kept its ledgers in", "n_predict": n, "temperature": 0.0, "top_k": 1,
            "stream": True, "cache_prompt": False}
    with httpx.stream("POST", base + "/completion", json=body, timeout=60) as r:
        (f / name).write_text("".join(line + "\n" for line in r.iter_lines()))
(f / "metrics_after.prom").write_text(httpx.get(base + "/metrics").text)
(f / "slots_after.json").write_text(httpx.get(base + "/slots").text)
EOF
  rc=$?
  smi > "$f/nvidia-smi-query-busy.csv"; apps > "$f/nvidia-smi-apps-busy.csv"
  kill "$pid"; wait "$pid" 2>/dev/null
  return $rc
}

for phase in "${phases[@]}"; do
  log "phase $phase"
  t0=$SECONDS
  case "$phase" in
  build|facts|models|fixtures) "phase_$phase" > "$R/evidence/phase-$phase.log" 2>&1; rc=$? ;;
  client)  # the wave client against a server stepping like llama-server at C=64 (benchmarks/client_bursts.py):
    # run first, on quiet cores; --strict fails the phase when the client-bound flag fires at any level
    python3 benchmarks/client_bursts.py --strict --levels "${CLIENT_LEVELS:-1,8,64}" --workers "${CLIENT_WORKERS:-8}" --out "$R/evidence/client-bursts.json" \
      > "$R/evidence/phase-client.log" 2>&1; rc=$? ;;
  nightly) lanebench nightly --hosts hosts.gpu.yaml --artifacts "$R/art" > "$R/evidence/phase-nightly.log" 2>&1; rc=$? ;;
  matrix) lanebench matrix matrix/gpu.yaml --artifacts "$R/art" > "$R/evidence/phase-matrix.log" 2>&1; rc=$? ;;
  kl) lanebench kl kl/gpu.yaml --artifacts "$R/art" > "$R/evidence/phase-kl.log" 2>&1; rc=$? ;;
  *) log "unknown phase $phase"; rc=2 ;;
  esac
  record "$phase" "$rc" $((SECONDS - t0))
  [ "$rc" -eq 0 ] || tail -30 "$R/evidence/phase-$phase.log" 2>/dev/null
done
smi > "$R/evidence/nvidia-smi-query-end.csv" 2>&1
log "done: $(awk -F'\t' '{printf "%s=%s ", $1, $2}' "$R/evidence/phases.tsv")"
exit "$failed"
