"""`python -m pallas_kernels.cpu`: builds the CPU kernel library for this machine (make runs it)."""

import sys

from pallas_kernels import cpu

try:
    print(f"CPU kernels: {cpu.build()}")
except RuntimeError as e:  # no compiler: the engine runs the XLA paths instead
    print(f"CPU kernels not built ({e}); the engine will use the XLA paths", file=sys.stderr)
