#!/usr/bin/env bash
# Non-test Python lines at the 637441f review and at REV (default HEAD), and at REV without the lines
# that features added since then still hold (git blame against scripts/feature-commits.tsv). The last
# figure is issue 26's "smaller for the same features": a lower bound on feature lines, since a
# feature line that a later structural commit rewrote or moved is blamed on that commit.
#   bash scripts/code-size.sh [REV]
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:-HEAD}"
base=637441f
py_files() { git ls-tree -r --name-only "$1" | grep '\.py$' | grep -v '^tests/'; }
lines_at() { py_files "$1" | while read -r f; do git show "$1:$f"; done | wc -l; }

features="$(grep -v '^#' scripts/feature-commits.tsv | cut -f1 | tr '\n' ' ')"
read -r total from_features < <(
  py_files "$rev" | while read -r f; do git blame -w --line-porcelain "$rev" -- "$f"; done | awk -v list="$features" '
      BEGIN { n = split(list, h, " "); for (i = 1; i <= n; i++) feature[h[i]] = 1 }
      length($1) == 40 && $1 ~ /^[0-9a-f]+$/ && NF >= 3 { commit = $1; next }
      /^\t/ { total++; if (commit in feature) from_features++ }
      END { printf "%d %d\n", total, from_features }')
printf 'non-test Python lines at %s: %d\n' "$base" "$(lines_at "$base")"
printf 'non-test Python lines at %s: %d\n' "$rev" "$total"
printf '  of which features added since %s still hold: %d\n' "$base" "$from_features"
printf '  the features %s had, as %s writes them: %d\n' "$base" "$rev" "$((total - from_features))"
