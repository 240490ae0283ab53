"""Experiments over the product: named grids of training runs, their statistics, the
collapse rule, the off-policy arena's leaderboards and the archive of finished runs.

``stppo experiment`` (``services/cli.py``) is the only product code that imports this
package; nothing in ``services``, ``learner``, ``actors``, ``retrieval_server`` or
``prepare`` does (``tests/unit/repository/test_layering.py``). Experiments depend on the product, the
product never on experiments.
"""
