#!/usr/bin/env bash
# What benchmarks/load_generator.py needs on a lent GPU machine (no registry there; a call
# carries at most 64 MiB), for issue 28's run on its 16 cores. Writes one folder, BUNDLE (default
# /work/main/.peers-bundle; keep it git-ignored) holding peers.tar.xz with three folders:
#
#   guidellm/   guidellm 0.8.1 and what it needs beyond the machine's image (KINDS.md lists it:
#               torch, transformers, tokenizers, numpy, pandas, pyarrow ... serve as they are there)
#   aiperf/     aiperf 0.13.0 and the packages `aiperf profile` imports beyond the image, read off
#               a real run (an import audit hook over the benchmark's aiperf calls, 2026-12-02):
#               its plotting and Kubernetes extras are left out
#   lanebench/  the load generator's own needs beyond the image (pydantic, orjson, at uv.lock's versions)
#
# There: tar -xJf .peers-bundle/peers.tar.xz -C /tmp/peers, then
#   PYTHONPATH=/tmp/peers/lanebench LANEBENCH_PEERS_SITE=/tmp/peers python3 benchmarks/load_generator.py ...
# (scripts/gpu-remote.sh loadgen does this). Versions: resolved for cp312 with the image's torch,
# transformers, tokenizers, huggingface-hub, numpy and safetensors held at the image's versions.
set -euo pipefail

BUNDLE="${1:-/work/main/.peers-bundle}"
PY="${PEERS_PYTHON:-3.12}"  # the machine's python3 (3.12.3 on the lent H200s); another to try it here
mkdir -p "$BUNDLE"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

GUIDELLM="guidellm==0.8.1 aiologic==0.17.1 culsans==0.10.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
loguru==0.7.3 more-itertools==11.2.1 msgpack==1.2.4 pydantic==2.14.4 pydantic-core==2.50.5
pydantic-settings==2.16.3 annotated-types==0.8.0 typing-inspection==0.4.5 python-dotenv==1.2.4
uvloop==0.23.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 faker==40.63.0 ftfy==6.3.1
wcwidth==0.9.4 websockets==17.4 wrapt==2.5.2 xxhash==4.1.0 multidict==6.9.1 click==8.4.2
httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 sanic==25.12.1
sanic-routing==23.12.0 tabulate==0.10.0 eval-type-backport==0.4.0 html5tagger==2.0.0
tracerite==2.6.5 httptools==0.9.0 ujson==6.1.0 aiofiles==25.1.0 tzdata==2026.6"
AIPERF="aiperf==0.13.0 aiofiles==24.1.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0
annotated-types==0.8.0 anyio==4.16.0 attrs==26.1.0 brotli==1.2.1 crick==0.0.8 cyclopts==4.25.3
python-dotenv==1.2.4 ffmpeg-python==0.2.0 future==1.0.0 h11==0.16.0 httpcore==1.0.9 msgspec==0.23.0
multidict==7.2.1 orjson==3.11.9 propcache==0.5.4 pydantic==2.14.4 pydantic-core==2.50.5
pydantic-settings==2.16.3 ruamel-yaml==0.18.17 ruamel-yaml-clib==0.2.15 setproctitle==1.3.8
typing-inspection==0.4.5 uvloop==0.23.0 yarl==1.25.1 pyzmq==26.4.0 zstandard==0.25.0 rich==14.1.0
docstring-parser==0.18.0 rich-rst==2.2.0 prometheus-client==0.23.1 frozenlist==1.8.0"
LANEBENCH="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 orjson==3.13.0
msgspec==0.23.0"

plats=(); for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_5; do
  plats+=(--platform "${p}_x86_64"); done
for name in guidellm aiperf lanebench; do
  declare -n pkgs="${name^^}"
  # shellcheck disable=SC2086  # one requirement a word
  python3 -m pip download -qq --no-deps --only-binary=:all: --python-version "$PY" --implementation cp --abi "cp${PY/./}" \
    "${plats[@]}" --platform any -d "$tmp/wheels-$name" $pkgs
  uv pip install -q --target "$tmp/site/$name" --python-version "$PY" --python-platform x86_64-manylinux_2_28 \
    --no-deps --no-index --no-compile "$tmp/wheels-$name"/*.whl
done
tar -C "$tmp/site" -cf - guidellm aiperf lanebench | xz -T0 -6 > "$BUNDLE/peers.tar.xz"
size=$(stat -c %s "$BUNDLE/peers.tar.xz")
echo "peers bundle: $BUNDLE/peers.tar.xz, $((size / 1048576)) MiB"
[ "$size" -lt $((48 * 1048576)) ] || { echo "peers bundle over 48 MiB" >&2; exit 1; }
