#!/usr/bin/env bash
# Build llama-server, llama-quantize and llama-perplexity from the llama.cpp tree vendored
# in a pinned llama-cpp-python source distribution. The build is cached outside the repo,
# keyed by the sdist's sha256, so it is rebuilt only when the pin changes.
# Prints the folder holding the binaries on its last line.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SHA256="${LLAMA_CPP_PYTHON_SHA256:-832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e}"
CACHE="${LANEBENCH_CACHE:-$HOME/.cache/lanebench}"
OUT="$CACHE/llama.cpp/$SHA256"
TARGETS=(llama-server llama-quantize llama-perplexity ggml-rpc-server)

if [ -x "$OUT/bin/llama-server" ] && [ -f "$OUT/.complete" ]; then
  echo "$OUT/bin"
  exit 0
fi
# One build at a time: two builds in one work folder corrupt each other's archives (seen when
# a test fixture asked for the build while ./setup was still making it).
mkdir -p "$CACHE/llama.cpp"
exec 9>"$CACHE/llama.cpp/.build.lock"
flock 9
if [ -x "$OUT/bin/llama-server" ] && [ -f "$OUT/.complete" ]; then
  echo "$OUT/bin"
  exit 0
fi

work="$CACHE/llama.cpp/$SHA256.work"  # kept on failure so a retry builds incrementally
mkdir -p "$work"
sdist="$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ] || ! echo "$SHA256  $sdist" | sha256sum -c --status; then
  mkdir -p "$CACHE/sdist"
  # pip is the ordinary registry client; --no-binary forces the source distribution. Under
  # `uv run` python3 is the project's venv, which has no pip: uvx brings one.
  pip_download() {
    if python3 -m pip --version >/dev/null 2>&1; then python3 -m pip download "$@"
    else uvx pip download "$@"; fi
  }
  pip_download --quiet --no-deps --no-binary :all: --no-build-isolation \
    -d "$CACHE/sdist" "llama-cpp-python==$VERSION" >&2 \
  || pip_download --quiet --no-deps --no-binary :all: -d "$CACHE/sdist" "llama-cpp-python==$VERSION" >&2
fi
echo "$SHA256  $sdist" | sha256sum -c --status || {
  echo "build-llama-cpp: $sdist does not match the pinned sha256 $SHA256" >&2; exit 1; }

[ -d "$work/llama_cpp_python-$VERSION" ] || tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DGGML_RPC=ON -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" -j"$(nproc)" --target "${TARGETS[@]}" >&2

rm -rf "$OUT"; mkdir -p "$OUT/bin"
for t in llama-server llama-quantize llama-perplexity; do cp "$work/build/bin/$t" "$OUT/bin/"; done
cp "$work/build/bin/ggml-rpc-server" "$OUT/bin/rpc-server" 2>/dev/null || cp "$work/build/bin/rpc-server" "$OUT/bin/rpc-server"
{ echo "llama-cpp-python==$VERSION"; echo "sdist_sha256=$SHA256"; } > "$OUT/SOURCE"
touch "$OUT/.complete"
rm -rf "$work"
echo "$OUT/bin"
