"""The KubeRay topology on one machine, in network namespaces (root only): a development
and test tool, not part of the installed packages. ``scripts/local_cluster.sh`` runs it
(``python -m local_cluster`` with ``deploy/`` on ``PYTHONPATH``); the tests that cross a
network import :mod:`local_cluster.netns` the same way (``tests/conftest.py``)."""
