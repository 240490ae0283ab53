#!/usr/bin/env bash
# Fetch the pinned Debian packages (stppo prepare's distractor text) into data/packages/
# with `apt-get download`, where apt works (a dev machine or CI). `stppo prepare` itself
# never calls apt (it runs as a non-root pod too) and checks every file's sha256; the
# container image pre-fetches the same files (deploy/Dockerfile). Idempotent.
set -uo pipefail
cd "$(dirname "$0")/.."
dest="${STPPO_DATA_DIR:-data}/packages"
mkdir -p "$dest"
mapfile -t pins < <(.venv/bin/python -m prepare.packages pins deb)
missing=()
for pin in "${pins[@]}"; do
  name=${pin%%=*}
  compgen -G "$dest/${name}_*.deb" >/dev/null || missing+=("$pin")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null; then
  echo "[fetch_debs] no apt-get: put ${missing[*]} into $dest yourself (see README)" >&2
  exit 0  # prepare then fails with the exact command to run
fi
SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
fi
download() { (cd "$dest" && apt-get download "${missing[@]}") >/dev/null 2>&1; }
if ! download; then
  echo "[fetch_debs] apt-get download failed; refreshing apt lists once" >&2
  $SUDO apt-get update -qq >/dev/null 2>&1 || true
  download || echo "[fetch_debs] could not download ${missing[*]}; stppo prepare will say how" >&2
fi
exit 0
