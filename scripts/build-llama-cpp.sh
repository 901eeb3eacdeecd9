#!/usr/bin/env bash
# Build llama-server, llama-quantize, llama-perplexity and rpc-server from the pinned llama.cpp
# tree, for one backend:
#
#   build-llama-cpp.sh [cpu|cuda]        (or LANEBENCH_LLAMA_BACKEND; default cpu)
#   LANEBENCH_CUDA_ARCHS="90"            CUDA architectures, `;`-separated (90 = Hopper)
#   LANEBENCH_LLAMA_SRC=DIR              a pre-fetched source tree (a machine with no network)
#
# The source is the llama.cpp tree vendored in the llama-cpp-python sdist, cut down to what
# these tools need, and every file of it is pinned by sha256 in scripts/llama-cpp-tree.sha256:
# a pre-fetched tree must match file for file, and one cut from a download must too (the
# sdist's own sha256 is checked first). The build is cached outside the repo, keyed by the
# source hash (sha256 of that manifest) and the backend, so a CPU and a CUDA build live side by
# side and each is rebuilt only when the pin changes. Prints the bin folder on its last line;
# the compiler's output goes to $CACHE/llama.cpp/<key>.log (printed only when a step fails).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SHA256="${LLAMA_CPP_PYTHON_SHA256:-832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e}"
CACHE="${LANEBENCH_CACHE:-$HOME/.cache/lanebench}"
BACKEND="${1:-${LANEBENCH_LLAMA_BACKEND:-cpu}}"
ARCHS="${LANEBENCH_CUDA_ARCHS:-90}"
TARGETS=(llama-server llama-quantize llama-perplexity ggml-rpc-server)

backend_flags=()
case "$BACKEND" in
  cpu) key_backend=cpu ;;
  cuda)
    [[ "$ARCHS" =~ ^[0-9]+[af]?(\;[0-9]+[af]?)*$ ]] || {
      echo "build-llama-cpp: LANEBENCH_CUDA_ARCHS='$ARCHS' is not a ';'-separated list of CUDA architectures. Fix: e.g. 90 (Hopper) or '80;90'" >&2; exit 2; }
    key_backend="cuda-${ARCHS//;/_}"
    backend_flags=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$ARCHS") ;;
  *) echo "build-llama-cpp: backend '$BACKEND' is not one of cpu, cuda. Fix: build-llama-cpp.sh cpu|cuda" >&2; exit 2 ;;
esac

SRC_HASH="$(python3 "$here/llama-cpp-tree.py" hash)"
KEY="${SRC_HASH:0:16}-$key_backend"
OUT="$CACHE/llama.cpp/$KEY"
done_already() { [ -x "$OUT/bin/llama-server" ] && [ -f "$OUT/.complete" ]; }
if done_already; then echo "$OUT/bin"; exit 0; fi

# One build at a time: two builds in one work folder corrupt each other's archives (seen when
# a test fixture asked for the build while ./setup was still making it).
mkdir -p "$CACHE/llama.cpp"
exec 9>"$CACHE/llama.cpp/.build.lock"
flock 9
if done_already; then echo "$OUT/bin"; exit 0; fi
log="$CACHE/llama.cpp/$KEY.log"
: >"$log"
step() {  # run a step with its output in the log; on failure show the log's tail and stop
  if ! "$@" >>"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "build-llama-cpp: '$1' failed for backend $BACKEND; whole log: $log" >&2
    exit 1
  fi
}

if [ -n "${LANEBENCH_LLAMA_SRC:-}" ]; then
  src="$LANEBENCH_LLAMA_SRC"
  python3 "$here/llama-cpp-tree.py" check "$src" || exit 1
else
  src="$CACHE/llama.cpp/src-${SRC_HASH:0:16}"
  if [ ! -f "$src/.complete" ]; then
    sdist="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
    if [ ! -f "$sdist" ] || ! echo "$SHA256  $sdist" | sha256sum -c --status; then
      mkdir -p "$CACHE/sdist"
      # pip is the ordinary registry client; --no-binary forces the source distribution, and pip
      # prepares its metadata in an isolated build environment (scikit-build-core from the
      # registry). Errors only (-qq): a pip.conf's unreachable extra indexes would otherwise
      # print "Location ... is ignored" warnings that are not ours. Under `uv run` python3 is
      # the project's venv, which has no pip: uvx brings one.
      if python3 -m pip --version >/dev/null 2>&1; then pip=(python3 -m pip); else pip=(uvx pip); fi
      "${pip[@]}" download -qq --no-deps --no-binary :all: -d "$CACHE/sdist" "llama-cpp-python==$VERSION" >&2
    fi
    echo "$SHA256  $sdist" | sha256sum -c --status || {
      echo "build-llama-cpp: $sdist does not match the pinned sha256 $SHA256" >&2; exit 1; }
    rm -rf "$src"
    python3 "$here/llama-cpp-tree.py" extract "$sdist" "$src"
    touch "$src/.complete"
  fi
fi

work="$CACHE/llama.cpp/$KEY.work"  # kept on failure so a retry builds incrementally
mkdir -p "$work"
start=$SECONDS
step cmake -S "$src" -B "$work" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DGGML_RPC=ON -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF "${backend_flags[@]}"
step cmake --build "$work" -j"$(nproc)" --target "${TARGETS[@]}"

rm -rf "$OUT"; mkdir -p "$OUT/bin"
for t in llama-server llama-quantize llama-perplexity; do cp "$work/bin/$t" "$OUT/bin/"; done
cp "$work/bin/ggml-rpc-server" "$OUT/bin/rpc-server" 2>/dev/null || cp "$work/bin/rpc-server" "$OUT/bin/rpc-server"
{ echo "llama-cpp-python==$VERSION"; echo "sdist_sha256=$SHA256"; echo "tree_sha256=$SRC_HASH"
  echo "backend=$key_backend"; echo "build_seconds=$((SECONDS - start))"; } > "$OUT/SOURCE"
touch "$OUT/.complete"
rm -rf "$work"
echo "$OUT/bin"
