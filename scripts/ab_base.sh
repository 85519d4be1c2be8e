#!/usr/bin/env bash
# The base for `scripts/gpu_check.sh abbench`: REV's version of every file in which the working
# tree differs from REV, written under .ab-base (ignored by git; the device call carries it). The
# tree's files that REV lacks are listed in .ab-base/.deleted, and REV itself in .ab-base/.rev.
# The device then builds the tree and the tree with these files over it side by side.
#   scripts/ab_base.sh main
#   (device) scripts/gpu_check.sh abbench    with carry [".deps", ".ab-base"]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/ab_base.sh REV}
rm -rf .ab-base
mkdir -p .ab-base
git rev-parse --short "$rev" > .ab-base/.rev
: > .ab-base/.deleted
{ git diff --name-only --no-renames "$rev" -- .; git ls-files --others --exclude-standard; } | sort -u |
  while read -r f; do
    if git cat-file -e "$rev:$f" 2>/dev/null; then
      mkdir -p ".ab-base/$(dirname "$f")"
      git show "$rev:$f" > ".ab-base/$f"
    else
      echo "$f" >> .ab-base/.deleted
    fi
  done
echo "base $(cat .ab-base/.rev): $(find .ab-base -type f ! -name '.rev' ! -name '.deleted' | wc -l) files, $(wc -l < .ab-base/.deleted) to delete"
