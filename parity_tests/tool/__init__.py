"""The shipped verification tool behind ``mha-parity`` (the tests live one level up).

- ``oracle``: an independent float64 NumPy multi-head attention, forward and gradients;
- ``arrays``: moving numbers between NumPy, JAX and PyTorch unchanged, and ``same_bits``;
- ``harness``: the grid of cases, running each implementation, and comparing them;
- ``workers``: the grid's cases in worker processes, split by what their compiled programs share;
- ``ports``: a user's checkpoint read into both frameworks (``verify --weights``, ``convert``);
- ``cli``: the ``mha-parity`` command.
"""
