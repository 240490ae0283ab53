#!/usr/bin/env bash
# The KubeRay topology on this machine, in network namespaces (needs root; see
# deploy/local_cluster/cluster.py and README "Run the cluster locally"):
#   scripts/local_cluster.sh up [--learners 2]
#   scripts/local_cluster.sh submit -- stppo train @/configs/k8s_synthetic.toml
#   scripts/local_cluster.sh exec client -- stppo ctl status
#   scripts/local_cluster.sh status | kill POD | down
set -euo pipefail
cd "$(dirname "$0")/.."
# the tool lives in deploy/local_cluster/, outside the installed packages
export PYTHONPATH="$PWD/deploy${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m local_cluster "$@"
