"""Offline assets: the model, the passage corpus, the QA sets and the retrieval index built
from pinned registry packages (``stppo prepare``, :mod:`prepare.run`), and the synthetic
search task (``stppo prepare-synthetic``, :mod:`prepare.synthetic_task`).

Built once, before any run; nothing here imports ``services`` or Ray
(``tests/unit/repository/test_layering.py``).
"""
