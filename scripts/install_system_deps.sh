#!/usr/bin/env bash
# System packages the test suite needs beyond the Python venv (idempotent; safe to re-run).
#   prometheus  Debian's Prometheus server, started on loopback by
#               tests/integration/test_prometheus_scrape.py to scrape services.metrics.
# Needs root (or passwordless sudo) for apt-get; without it, or without a reachable Debian
# mirror, it says so and exits 1 (make test stops: the Prometheus tests would not run),
# unless STPPO_ALLOW_SKIP lists "prometheus" (then it warns, exits 0, and those tests skip).
set -uo pipefail

cannot_install() {  # $1 = why
  echo "[install_system_deps] $1" >&2
  local allow=",${STPPO_ALLOW_SKIP:-},"
  case "${allow// /}" in
    *,prometheus,*)
      echo "[install_system_deps] STPPO_ALLOW_SKIP includes prometheus: continuing; the Prometheus tests will skip" >&2
      exit 0 ;;
  esac
  echo "[install_system_deps] install it, or set STPPO_ALLOW_SKIP=prometheus to run without (see README)" >&2
  exit 1
}

PACKAGES=(prometheus)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "[install_system_deps] already installed: ${PACKAGES[*]}"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    cannot_install "not root and no passwordless sudo: cannot install ${missing[*]}"
  fi
fi
if ! command -v apt-get >/dev/null; then
  cannot_install "no apt-get (not Debian/Ubuntu): cannot install ${missing[*]}"
fi

export DEBIAN_FRONTEND=noninteractive
echo "[install_system_deps] installing: ${missing[*]}"
# policy-rc.d 101: do not start the packaged systemd/init service; tests start their own
# Prometheus on loopback with a generated config.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null && $SUDO chmod +x "$policy" && created_policy=1
fi
rc=0
$SUDO apt-get update -qq || rc=$?
if [ $rc -eq 0 ]; then
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" || rc=$?
fi
if [ $created_policy -eq 1 ]; then
  $SUDO rm -f "$policy"
fi
if [ $rc -ne 0 ]; then
  cannot_install "apt-get failed (rc=$rc): ${missing[*]} not installed"
fi
for pkg in "${missing[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    cannot_install "$pkg still not installed after apt-get"
  fi
done
exit 0
