"""The namespace cluster tool (deploy/local_cluster) deletes only what it made: its state
directory is marked by ``up``, and ``down`` or ``up`` refuse an unmarked folder with files
(an empty ``state_dir`` is the current directory: a checkout)."""

from __future__ import annotations

import pytest
from local_cluster import cluster as cluster_module
from local_cluster.cluster import OWNED_MARKER, ClusterError, LocalCluster


def test_down_refuses_a_folder_the_cluster_did_not_make(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster_module, "remove_all", lambda prefix: [])  # no namespaces here
    checkout = tmp_path / "checkout"
    (checkout / ".git").mkdir(parents=True)
    (checkout / "README.md").write_text("keep me")
    with pytest.raises(ClusterError, match="not a local cluster's state directory"):
        LocalCluster(checkout, prefix="stt", subnet="10.213.99.0/24").down()
    assert (checkout / "README.md").read_text() == "keep me" and (checkout / ".git").is_dir()
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    (state / "pods").mkdir()
    (state / OWNED_MARKER).touch()
    LocalCluster(state, prefix="stt", subnet="10.213.99.0/24").down()
    assert sorted(p.name for p in state.iterdir()) == [OWNED_MARKER, "logs"]
