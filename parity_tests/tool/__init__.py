"""The shipped verification tool behind ``mha-parity`` (the tests live one level up).

- ``oracle``: an independent float64 NumPy multi-head attention, forward and gradients;
- ``arrays``: moving numbers between NumPy, JAX and PyTorch unchanged, and ``same_bits``;
- ``cases``: what the grid is made of, and its two grids (covering and full);
- ``harness``: running each implementation on a case, and comparing them;
- ``workers``: many cases, in worker processes split by what their compiled programs share;
- ``compile_cache``: JAX's persistent compilation cache for ``verify``;
- ``ports``: a user's checkpoint read into both frameworks (``verify --weights``, ``convert``);
- ``cli``: the ``mha-parity`` command.
"""
