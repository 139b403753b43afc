__version__ = '0.1.0'

# The oldest torch the test suite passes on (docs/tests.md, "Against an older
# torch"): older ones fail to import the package (torch 2.6) or to trace it
# (torch 2.9: torch.jit.trace, so the FLOP counts; torch 2.6: compile, export).
TORCH_MINIMUM = '2.11'


def check_torch(version: str) -> None:
    """An ImportError naming torch's ``version`` if it is older than
    :data:`TORCH_MINIMUM` (a local tag such as ``+cu130`` is ignored)."""
    def release(v: str) -> tuple:
        return tuple(int(p) for p in v.split('+')[0].split('.')[:2])
    if release(version) < release(TORCH_MINIMUM):
        raise ImportError(f'flatten_mm needs torch >= {TORCH_MINIMUM}, found torch {version}: '
                          f'pip install "torch>={TORCH_MINIMUM}"')
