#!/usr/bin/env bash
# make demo's step 2 (scripts/demo.sh), on its own so the tests make the copy as the demo does:
#   scripts/demo-copy.sh PROJECT
# copies the checkout's code (tracked and untracked files as they are in the working tree; ignored
# ones left out: .venv, .spikelab, caches) into PROJECT with the smoke profile and the demo's declared
# family (scripts/demo-studies.yaml as its studies.yaml). A previous copy's
# outputs and DVC cache are kept, so DVC reruns only what changed. The copy is a DVC project of
# its own, not a git repository, and its .dvc/config.local (never copied: git ignores it) names
# the owner's private site cache, as scripts/setup.sh does for the checkout: a `dvc` typed there
# later, in a shell without make's environment, never uses DVC's default /var/tmp/dvc (folders
# 0777 another user can make first, with pickled link caches DVC loads).
set -euo pipefail
checkout=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
project=${1:?usage: scripts/demo-copy.sh PROJECT}
source "$checkout/scripts/private-env.sh"  # umask; DVC_SITE_CACHE_DIR: <state>/scratch/dvc, 0700
export PATH="$checkout/.venv/bin:$PATH"
fresh=$project.new
rm -rf "$fresh"
mkdir -p "$fresh"
(
  cd "$checkout"
  git ls-files -z -co --exclude-standard | while IFS= read -r -d '' file; do
    if [ -e "$file" ] || [ -L "$file" ]; then printf '%s\0' "$file"; fi
  done | xargs -0 cp -P --parents -t "$fresh"
)
if [ -d "$project" ]; then # the previous demo's results and cache: DVC reruns only what changed
  for kept in dvc.lock params data metrics models plots reports runs search .dvc/cache .spikelab; do
    if [ -e "$project/$kept" ]; then
      rm -rf "${fresh:?}/$kept"
      mv "$project/$kept" "$fresh/$kept"
    fi
  done
  rm -rf "$project"
fi
mv "$fresh" "$project"
cd "$project"
sed -i -E 's/^profile: .*/profile: smoke/' params.yaml
cp "$checkout/scripts/demo-studies.yaml" studies.yaml # the demo's one decided claim (why: that file)
grep -q '^profile: smoke$' params.yaml || { echo "demo: params.yaml has no top-level profile key" >&2; exit 2; }
dvc config --local core.no_scm true # a copy, not a git repository: DVC leaves git alone
dvc config --local core.site_cache_dir "$DVC_SITE_CACHE_DIR"
