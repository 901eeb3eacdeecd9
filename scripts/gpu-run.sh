#!/usr/bin/env bash
# Prepare what travels to a lent GPU machine (no network there; files arrive as a copy of a
# checkout plus carried folders, at most 64 MiB), exactly as the H200 runs of docs/gpu.md were
# made. Writes one folder, BUNDLE (default /work/main/.gpu-bundle; keep it git-ignored):
#
#   code.tar.gz       this checkout's files (tracked and untracked-not-ignored), minus the testbed
#                     GGUFs, which the checkout on the machine already holds
#   llama-src.tar.xz  the pinned llama.cpp tree (scripts/llama-cpp-tree.sha256), ~8 MB unpacked
#   site.tar.xz       lanebench's locked dependencies the machine's image lacks, installed for
#                     cp312 manylinux x86_64 into one folder, gpusite/ (PYTHONPATH there)
#   gguf-*.whl        the testbed script's GGUF writer (the random model is generated there)
#   gpu-remote.sh     what runs there (scripts/gpu-remote.sh)
#
# Then, on the machine, from the checkout's root with BUNDLE carried as .gpu-bundle:
#   bash .gpu-bundle/gpu-remote.sh all        (build, facts, nightly, matrix, kl, fixtures)
# Phases can be split across calls to a warm machine: `build nightly` then `matrix kl fixtures`.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
BUNDLE="${1:-/work/main/.gpu-bundle}"
CACHE="${LANEBENCH_CACHE:-$HOME/.cache/lanebench}"
mkdir -p "$BUNDLE"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# 1. The code, and the commit it is (no .git travels: run_folder.git_identity reads
#    .lanebench-git.json instead, so every manifest made there names the commit).
printf '{"git_sha": "%s", "dirty": %s}\n' "$(git -C "$repo" rev-parse HEAD)" \
  "$([ -z "$(git -C "$repo" status --porcelain)" ] && echo false || echo true)" > "$tmp/.lanebench-git.json"
git -C "$repo" ls-files -co --exclude-standard -z | grep -zv '^testbed/models/.*\.gguf$' \
  | tar -C "$repo" --null -T - -cf "$tmp/code.tar"
tar -C "$tmp" -rf "$tmp/code.tar" .lanebench-git.json
gzip -9c "$tmp/code.tar" > "$BUNDLE/code.tar.gz"

# 2. The pinned llama.cpp tree, cut from the pinned sdist (downloaded and checked if missing).
sdist="$CACHE/sdist/llama_cpp_python-0.3.36.tar.gz"
[ -f "$sdist" ] || LANEBENCH_CACHE="$CACHE" bash "$here/build-llama-cpp.sh" cpu >/dev/null
tree_hash="$(python3 "$here/llama-cpp-tree.py" hash)"
if [ "$(cat "$BUNDLE/llama-src.tree" 2>/dev/null)" != "$tree_hash" ]; then
  python3 "$here/llama-cpp-tree.py" extract "$sdist" "$tmp/llama-src"
  tar -C "$tmp" -cJf "$BUNDLE/llama-src.tar.xz" llama-src
  echo "$tree_hash" > "$BUNDLE/llama-src.tree"
fi

# 3. The Python dependencies the machine's image lacks (KINDS.md lists the image's packages:
#    those below serve as they are there, at the image's versions). xz: wheels are zip-deflated
#    and compress as one stream. The bundle must stay under 48 MiB (checked at the end).
IMAGE_HAS='numpy|pandas|pyarrow|scipy|matplotlib|pillow|fonttools|contourpy|kiwisolver|pywin32|cycler|pyparsing|narwhals'
IMAGE_HAS+='|pygments|markdown-it-py|mdurl|rich|regex|jinja2|markupsafe|pyyaml|requests|urllib3|certifi|idna'
IMAGE_HAS+='|charset-normalizer|httpx|httpcore|h11|anyio|click|typer|shellingham|python-dateutil|six|tqdm'
IMAGE_HAS+='|cloudpickle|fsspec|packaging|pluggy|prometheus-client|typing-extensions|attrs|humanize|markdown'
(cd "$repo" && uv export --frozen --no-dev --no-hashes --no-emit-project) | grep -v '^ *#' | grep -v '^ ' \
  | sed 's/ ;.*//' | grep -vE "^($IMAGE_HAS)==" \
  > "$tmp/reqs.txt"
plats=(); for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_31 manylinux_2_34 manylinux_2_5; do plats+=(--platform "${p}_x86_64"); done
# A lock that gained packages since site.tar.xz was made (xz -9 takes minutes): the new ones travel
# as wheels beside it (extra-*.whl), unpacked into the same folder there.
rm -f "$BUNDLE"/extra-*.whl
if [ -f "$BUNDLE/site.tar.xz" ] && [ -f "$BUNDLE/site.reqs" ] && [ "${REBUILD_SITE:-0}" != 1 ]; then
  grep -vxFf "$BUNDLE/site.reqs" "$tmp/reqs.txt" > "$tmp/new.txt" || true
  if [ -s "$tmp/new.txt" ]; then
    python3 -m pip download -qq --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
      "${plats[@]}" --platform any -d "$tmp/extra" -r "$tmp/new.txt"
    for w in "$tmp"/extra/*.whl; do cp "$w" "$BUNDLE/extra-$(basename "$w")"; done
  fi
fi
if [ ! -f "$BUNDLE/site.tar.xz" ] || [ ! -f "$BUNDLE/site.reqs" ] || [ "${REBUILD_SITE:-0}" = 1 ]; then
  python3 -m pip download -qq --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    "${plats[@]}" --platform any -d "$tmp/wheels" -r "$tmp/reqs.txt"
  uv pip install -q --target "$tmp/gpusite" --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
    --no-deps --no-index --no-compile "$tmp"/wheels/*.whl
  # Prefect's Apprise notification blocks (8 MB) are imported only when one sends through
  # Apprise, which no GPU run does; without them the bundle fits under 48 MiB.
  rm -rf "$tmp"/gpusite/apprise "$tmp"/gpusite/apprise-*.dist-info
  tar -C "$tmp" -cJf "$BUNDLE/site.tar.xz" gpusite
  cp "$tmp/reqs.txt" "$BUNDLE/site.reqs"
fi
gguf="gguf==$(cd "$repo" && uv export --frozen --only-dev --no-hashes | sed -n 's/^gguf==\([^ ]*\).*/\1/p')"
rm -f "$BUNDLE"/gguf-*.whl
python3 -m pip download -qq --no-deps --only-binary=:all: -d "$BUNDLE" "$gguf"

cp "$here/gpu-remote.sh" "$BUNDLE/gpu-remote.sh"
du -sh "$BUNDLE"/*
total=$(du -cb "$BUNDLE"/* | tail -1 | cut -f1)
echo "bundle: $((total / 1048576)) MiB"
[ "$total" -lt $((48 * 1048576)) ] || { echo "the bundle is over 48 MiB: trim site.tar.xz (IMAGE_HAS)" >&2; exit 1; }
echo "carry: .gpu-bundle    command: bash .gpu-bundle/gpu-remote.sh all"
