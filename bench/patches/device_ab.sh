#!/bin/bash
# Build .gpu/snap for one device call: the working tree's HEAD (with the patches of this folder committed on a
# scratch branch) as the new tree, main as old/ (both full trees: each runs its own Python and kernels). See README.md.
set -e
cd "$(git rev-parse --show-toplevel)"
NEW=$(git rev-parse HEAD); OLD=$(git rev-parse main)
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu/snap && mkdir -p .gpu/snap/old
git archive "$NEW" | tar -x -C .gpu/snap
git archive "$OLD" | tar -x -C .gpu/snap/old
sed -e "s/@NEW@/$NEW/g" -e "s/@OLD@/$OLD/g" bench/patches/run.template.sh > .gpu/snap/run.sh
chmod +x .gpu/snap/run.sh
echo "snapshot: new $NEW, old (main) $OLD; carry .gpu/snap and .whl (transformers 5.25 and its wheels)"
