"""Kernel tests import their shared batch generator as `from ragged_cases import ...`.

Pytest already puts this directory on sys.path while it has no `__init__.py`; pinning it here keeps
that import working if the directory ever becomes a package like `tests/engine`.
"""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
