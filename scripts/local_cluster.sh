#!/usr/bin/env bash
# The KubeRay topology on this machine, in network namespaces (needs root; see
# services/local_cluster.py and README "Run the cluster locally"):
#   scripts/local_cluster.sh up [--learners 2]
#   scripts/local_cluster.sh submit -- stppo train @/configs/k8s_synthetic.toml
#   scripts/local_cluster.sh exec client -- stppo ctl status
#   scripts/local_cluster.sh status | kill POD | down
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m services.local_cluster "$@"
