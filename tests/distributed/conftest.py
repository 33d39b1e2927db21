"""Multi-process tests: each starts gloo ranks through dist_harness.run_ranks.

Rank processes import the worker functions by module name, so this folder must be importable
from sys.path in the test process (whose sys.path the rank processes copy).
"""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
