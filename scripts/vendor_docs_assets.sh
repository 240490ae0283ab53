#!/usr/bin/env bash
# Refresh the third-party assets the docs site serves itself (docs/assets/katex/,
# docs/assets/mermaid/), so that the built site loads nothing from outside
# (scripts/check_site_offline.py, run by `make docs`, fails if a page does).
#
# The files are committed: `make docs` needs no network. Run this only to change a version:
# set the version and the tarball's sha1 (npm's `dist.shasum`) below, run it, rebuild the
# site, commit docs/assets/. Sources, from the npm registry:
#   KaTeX 0.19.1, MIT (docs/assets/katex/LICENSE): katex.min.js, katex.min.css,
#     contrib/auto-render.min.js and the woff2 fonts (the stylesheet is cut to woff2 only:
#     every browser that runs the site reads woff2; the woff and ttf copies are not shipped)
#   Mermaid 11.17.2, MIT (docs/assets/mermaid/LICENSE): mermaid.min.js. Material for MkDocs
#     9.x uses the global `mermaid` when a page defines one, and otherwise fetches mermaid@11
#     from unpkg, so the major version must stay 11.
set -euo pipefail
cd "$(dirname "$0")/.."

KATEX_VERSION=0.19.1
KATEX_SHA1=ba2685811cdbffc54dfb7d55bd440c6cc6bb8795
MERMAID_VERSION=11.17.2
MERMAID_SHA1=e3caf3717582c0e44e5d04cff043e025caec7cba

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fetch() {  # fetch NAME VERSION SHA1 -> $tmp/NAME/package
  local name=$1 version=$2 sha1=$3
  curl -fsSL --retry 3 -o "$tmp/$name.tgz" "https://registry.npmjs.org/$name/-/$name-$version.tgz"
  echo "$sha1  $tmp/$name.tgz" | sha1sum -c --quiet -
  mkdir -p "$tmp/$name"
  tar xzf "$tmp/$name.tgz" -C "$tmp/$name"
}

fetch katex "$KATEX_VERSION" "$KATEX_SHA1"
k=docs/assets/katex
rm -rf "$k"
mkdir -p "$k/contrib" "$k/fonts"
cp "$tmp/katex/package/dist/katex.min.js" "$k/"
cp "$tmp/katex/package/dist/contrib/auto-render.min.js" "$k/contrib/"
cp "$tmp/katex/package/dist/fonts/"*.woff2 "$k/fonts/"
cp "$tmp/katex/package/LICENSE" "$k/LICENSE"
# src:url(fonts/X.woff2) format("woff2"),url(fonts/X.woff) format("woff"),url(...ttf) ... -> woff2 only
sed -E 's/(format\("woff2"\)),url\([^)]*\.woff\) format\("woff"\),url\([^)]*\.ttf\) format\("truetype"\)/\1/g' \
  "$tmp/katex/package/dist/katex.min.css" >"$k/katex.min.css"
if grep -qE '\.(woff|ttf)\)' "$k/katex.min.css"; then
  echo "katex.min.css still names a woff or ttf font: update the sed above" >&2
  exit 1
fi
echo "KaTeX $KATEX_VERSION (npm katex-$KATEX_VERSION.tgz, sha1 $KATEX_SHA1), MIT" >"$k/VERSION"

fetch mermaid "$MERMAID_VERSION" "$MERMAID_SHA1"
m=docs/assets/mermaid
rm -rf "$m"
mkdir -p "$m"
cp "$tmp/mermaid/package/dist/mermaid.min.js" "$m/"
cp "$tmp/mermaid/package/LICENSE" "$m/LICENSE"
echo "Mermaid $MERMAID_VERSION (npm mermaid-$MERMAID_VERSION.tgz, sha1 $MERMAID_SHA1), MIT" >"$m/VERSION"

du -sh docs/assets/katex docs/assets/mermaid
