"""``python -m local_cluster`` (``scripts/local_cluster.sh``): the cluster's command line."""

from local_cluster.cluster import app

app()
