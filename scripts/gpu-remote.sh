#!/usr/bin/env bash
# What runs on the lent GPU machine (scripts/gpu-run.sh prepares the bundle; docs/gpu.md).
# From the root of the checkout that travelled, with the bundle at .gpu-bundle:
#   bash .gpu-bundle/gpu-remote.sh PHASE...      PHASE: build facts fixtures nightly matrix kl, or all
# Everything it writes lands in $OUT/results.tar.gz (run folders, evidence, fixtures, logs).
# Re-running on a warm machine reuses the unpacked dependencies and the cached CUDA build.
set -uo pipefail

start=$SECONDS
BUDGET="${BUDGET:-570}"                 # seconds this call may use (the device allows 600)
B="$PWD/.gpu-bundle"
W=/tmp/lb                               # the code, unpacked fresh each call
DEPS=/tmp/lbdeps                        # site-packages, kept while the machine stays warm
R=/tmp/lbresults                        # what comes back, accumulated across calls
OUT="${OUT:-/tmp/out}"
phases=("$@"); [ "${phases[*]:-all}" = all ] && phases=(build facts fixtures nightly matrix kl)
mkdir -p "$R/evidence" "$R/fixtures" "$R/art" "$OUT"
log() { echo "[gpu-remote $((SECONDS - start))s] $*"; }
left() { echo $((BUDGET - (SECONDS - start) - 25)); }   # keep 25 s to pack the results
pack() {
  cp "$0" "$R/evidence/gpu-remote.sh" 2>/dev/null
  tar -C "$R" -czf "$OUT/results.tar.gz" . && log "packed $(du -h "$OUT/results.tar.gz" | cut -f1)"
}
trap pack EXIT

# REHEARSAL=1: a dry run on a CPU machine whose python3 already has the dependencies.
if [ "${REHEARSAL:-0}" = 1 ]; then backend=cpu; else backend=cuda; fi
if [ "${REHEARSAL:-0}" != 1 ] && [ ! -d "$DEPS/gpusite" ]; then
  mkdir -p "$DEPS" && tar -xJf "$B/site.tar.xz" -C "$DEPS" \
    && python3 -m zipfile -e "$(ls "$B"/gguf-*.whl)" "$DEPS/gpusite" && log "dependencies unpacked"
fi
rm -rf "$W" && mkdir -p "$W" && tar -xzf "$B/code.tar.gz" -C "$W"
mkdir -p "$W/testbed/models" && cp testbed/models/*.gguf "$W/testbed/models/"        # the checkout that travelled holds them
[ -d /tmp/llama-src ] || tar -xJf "$B/llama-src.tar.xz" -C /tmp
export PYTHONPATH="$DEPS/gpusite:$W" PYTHONUNBUFFERED=1 DO_NOT_TRACK=1 PREFECT_HOME=/tmp/prefect \
  LANEBENCH_CACHE=/tmp/lbcache LANEBENCH_LLAMA_BACKEND=$backend LANEBENCH_CUDA_ARCHS=90 LANEBENCH_LLAMA_SRC=/tmp/llama-src
cd "$W"
lanebench() { timeout "$(left)" python3 -c 'import sys; from flows.cli import main; sys.exit(main())' "$@"; }
smi() { nvidia-smi --query-gpu="$(python3 -c 'from tasks.hosts.gpu import QUERY; print(QUERY)')" --format=csv,noheader,nounits; }
apps() { nvidia-smi --query-compute-apps="$(python3 -c 'from tasks.hosts.gpu import APPS; print(APPS)')" --format=csv,noheader,nounits; }

for phase in "${phases[@]}"; do
  [ "$(left)" -gt 20 ] || { log "out of time before $phase"; break; }
  log "phase $phase"
  case "$phase" in
  build)
    { nproc; uname -r; nvcc --version | tail -2; cmake --version | head -1; python3 --version; } > "$R/evidence/machine.txt" 2>&1
    t0=$SECONDS
    bin="$(timeout "$(left)" bash scripts/build-llama-cpp.sh)"; rc=$?
    echo "rc=$rc seconds=$((SECONDS - t0)) bin=$bin" > "$R/evidence/cuda-build.txt"
    cp /tmp/lbcache/llama.cpp/*.log "$R/evidence/" 2>/dev/null
    [ -n "$bin" ] && cat "$(dirname "$bin")/SOURCE" >> "$R/evidence/cuda-build.txt"
    log "cuda build rc=$rc in $((SECONDS - t0)) s" ;;
  facts)
    smi > "$R/fixtures/nvidia-smi-query-idle.csv"; apps > "$R/fixtures/nvidia-smi-apps-idle.csv"
    nvidia-smi > "$R/fixtures/nvidia-smi-banner.txt"; nvidia-smi -q > "$R/evidence/nvidia-smi-q.txt"
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
    cat "$R/evidence/bandwidth.json"
    t0=$SECONDS
    python3 testbed/random_model.py --params 1.5e9 --out /tmp/lanebench-random-f16.gguf > "$R/evidence/random-model.txt" 2>&1
    log "random model in $((SECONDS - t0)) s: $(cat "$R/evidence/random-model.txt")" ;;
  fixtures)
    # A CUDA llama-server with the testbed target and drafter, as the testbed-gpu lane boots it:
    # its boot log, /props, /slots, /metrics and streams become CI's fixtures.
    bin="$(bash scripts/build-llama-cpp.sh)" || continue
    f="$R/fixtures"
    "$bin/llama-server" --model testbed/models/target-f16.gguf --host 127.0.0.1 --port 18399 --parallel 2 \
      --ctx-size 1024 --metrics --no-webui --model-draft testbed/models/drafter-good-f16.gguf \
      --spec-type draft-simple --spec-draft-n-max 4 --spec-draft-n-min 0 --spec-draft-p-min 0.0 \
      --n-gpu-layers all --n-gpu-layers-draft all > "$f/boot.log" 2>&1 &
    pid=$!
    timeout 120 python3 - "$f" <<'EOF'
import json, sys, time, pathlib, httpx
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
    smi > "$f/nvidia-smi-query-busy.csv"; apps > "$f/nvidia-smi-apps-busy.csv"
    kill "$pid"; wait "$pid" 2>/dev/null
    # The same boot at verbosity 4: libllama's load lines ("offloaded N/M layers to GPU") appear
    # only there.
    "$bin/llama-server" --model testbed/models/target-f16.gguf --host 127.0.0.1 --port 18399 --parallel 2 \
      --ctx-size 1024 --metrics --no-webui --model-draft testbed/models/drafter-good-f16.gguf \
      --spec-type draft-simple --spec-draft-n-max 4 --n-gpu-layers all --n-gpu-layers-draft all -lv 4 \
      > "$f/boot-verbose.log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do grep -q "listening on" "$f/boot-verbose.log" && break; sleep 0.2; done
    kill "$pid"; wait "$pid" 2>/dev/null
    log "fixtures: $(ls "$f" | tr '\n' ' ')" ;;
  nightly) lanebench nightly --hosts hosts.gpu.yaml --artifacts "$R/art" 2>&1 | tail -40 ;;
  nightly-testbed) lanebench nightly --hosts hosts.gpu.yaml --lane testbed-gpu --lane testbed-gpu-nodraft \
                     --artifacts "$R/art" 2>&1 | tail -20 ;;
  matrix) lanebench matrix matrix/gpu.yaml --artifacts "$R/art" 2>&1 | tail -30 ;;
  kl) lanebench kl kl/gpu.yaml --artifacts "$R/art" 2>&1 | tail -30 ;;
  *) log "unknown phase $phase" ;;
  esac
done
smi > "$R/evidence/nvidia-smi-query-end.csv" 2>&1
log "done"
