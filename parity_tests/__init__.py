

def __getattr__(name: str):
    """``parity_tests.compare`` (a whole PyTorch model against its Flax port, ``parity_tests.porting``)
    and ``parity_tests.verify`` (an attention on the grid), imported when first used."""
    if name == "compare":
        from parity_tests.porting import compare

        return compare
    if name == "verify":
        from parity_tests.tool.callables import verify

        return verify
    raise AttributeError(f"module 'parity_tests' has no attribute {name!r}")
