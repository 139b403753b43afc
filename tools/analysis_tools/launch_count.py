"""flatten_mm's Triton ops counted by the kernels they launch, without a GPU.

A ``flatten_mm::triton_*`` op is one call to the dispatcher, but its
implementation launches several kernels, each a sweep over the tokens that
reads its tensors from memory again: the forward's row statistics, state and
output passes read q and k twice each, and the backward's passes read q, g, k
and v once or twice (``flatten_mm/models/ops/triton_backend.py``). Counted as
one op (its inputs and outputs once), the core's traffic is undercounted.

:func:`counted_launches` runs each op's own host code (``triton_backend`` /
``triton_conv``: tilings, buffers, the chunk sums torch adds) on the op's fake
CUDA tensors, with every kernel replaced by a recorder that launches nothing
and counts the tensors the launch hands the kernel, each once at its own
extent, as Inductor counts a kernel's buffers. A tensor the kernel does not
touch under the launch's compile-time flags (``if WHOLE_ROWS:``-style blocks in
its source; :func:`used_params`) is not counted; a tensor passed for an absent
one (the mask's, the bias's: the host code hands the kernel another of its
tensors) is counted once, as the same tensor; a tensor a kernel adds to in
place (the same tensor as the conv's ``base`` and ``out``: :data:`IN_PLACE`)
twice, read and written. Tiling is an H100/H200's (132
multiprocessors, sm_90), also in a process that loaded the kernels for Triton's
interpreter. What a kernel re-reads within itself (a program's
state, cached rows) or finds in cache is not seen.
"""
import ast
import contextlib
import functools
import inspect
import textwrap
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from unittest import mock

import torch

SM90_PROPERTIES = (132, (9, 0))  # multiprocessors and capability of an H100 / H200


def _flag(test: ast.expr) -> Optional[Tuple[str, bool]]:
    """(name, value) of an ``if NAME:`` or ``if not NAME:`` test, else None."""
    if isinstance(test, ast.Name):
        return test.id, True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and \
            isinstance(test.operand, ast.Name):
        return test.operand.id, False
    return None


@functools.lru_cache(maxsize=None)
def param_uses(fn: Callable) -> Tuple[Tuple[str, ...], Dict[str, List[tuple]]]:
    """A kernel function's parameters, and for each one it uses the conditions
    of every use: the (flag, value) pairs of the ``if FLAG:`` / ``if not FLAG:``
    blocks around it in the kernel's own body (a use inside a helper the kernel
    calls is the call's, unconditional unless the call is in such a block)."""
    func = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    params = tuple(arg.arg for arg in func.args.args)
    uses = {}

    def visit(node: ast.AST, conds: tuple) -> None:
        flag = _flag(node.test) if isinstance(node, ast.If) else None
        if flag is not None:
            for child in node.body:
                visit(child, conds + (flag, ))
            for child in node.orelse:
                visit(child, conds + ((flag[0], not flag[1]), ))
            return
        if isinstance(node, ast.Name) and node.id in params:
            uses.setdefault(node.id, []).append(conds)
        for child in ast.iter_child_nodes(node):
            visit(child, conds)
    for statement in func.body:
        visit(statement, ())
    return params, uses


def used_params(fn: Callable, given: dict) -> List[str]:
    """The parameters of kernel function ``fn`` that a launch with arguments
    ``given`` (name -> value) uses: some use whose flags all hold (a flag not
    given counts as holding)."""
    _, uses = param_uses(fn)
    return [name for name, conds in uses.items()
            if any(all(flag not in given or bool(given[flag]) == value for flag, value in c)
                   for c in conds)]


# (read, written) parameters of a kernel that may be one tensor, updated in place
IN_PLACE = (('base_ptr', 'out_ptr'), )


def launch_bytes(fn: Callable, args: tuple, kwargs: dict) -> int:
    """Bytes of the distinct tensors a launch of kernel function ``fn`` uses,
    each at its own extent (a view: what it spans); one updated in place
    (:data:`IN_PLACE`) counts twice."""
    params, _ = param_uses(fn)
    given = dict(zip(params, args), **kwargs)
    used = used_params(fn, given)
    seen, total = set(), 0
    for name in used:
        t = given.get(name)
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for read, written in IN_PLACE:
        t = given.get(read)
        if read in used and written in used and isinstance(t, torch.Tensor) and \
                t is given.get(written):
            total += t.numel() * t.element_size()
    return total


class RecordedKernel:
    """``kernel[grid](*args, **kwargs)`` that launches nothing and calls
    ``record(name, kernel, grid, args, kwargs)`` instead."""

    def __init__(self, kernel: Any, name: str, record: Callable[..., None]):
        self.kernel, self.name, self.record = kernel, name, record  # a triton.JITFunction

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.record(self.name, self.kernel, grid, args, kwargs)


def kernel_modules() -> Tuple[ModuleType, ModuleType]:
    """The attention and the conv kernels modules (imported on first use)."""
    from flatten_mm.models.ops import triton_backend, triton_conv
    return triton_backend.kernels(), triton_conv.kernels()


@contextlib.contextmanager
def launches_recorded(record: Callable[..., None]) -> Iterator[None]:
    """While open, every Triton kernel (``_NAME_kernel``) of both kernels modules
    is a :class:`RecordedKernel` calling ``record``: the launchers run, no
    kernel does (also ``kernel_resources.py``'s recorder)."""
    with contextlib.ExitStack() as stack:
        for module in kernel_modules():
            for name in [n for n in vars(module) if n.startswith('_') and n.endswith('_kernel')]:
                stack.enter_context(mock.patch.object(
                    module, name, RecordedKernel(getattr(module, name), name, record)))
        yield


def python_function(kernel: Any) -> Callable:
    """The Python function under a JITFunction (or an autotuner around one)."""
    while not inspect.isfunction(kernel):
        kernel = kernel.fn
    return kernel


@contextlib.contextmanager
def counted_launches() -> Iterator[Dict[str, Callable]]:
    """While open, the kernels of both Triton modules record their launches
    instead of running (tiled for an sm_90 GPU of 132 multiprocessors); yields
    ``profile_backbone.tally_ops``'s ``inside`` map: each ``flatten_mm::triton_*``
    op to a function that runs the op's host code on its arguments and returns
    the launches it made."""
    from flatten_mm.models.ops import triton_backend, triton_conv, triton_fused
    impls = {'flatten_mm::triton_focused_attention': triton_backend._forward_impl,
             'flatten_mm::triton_focused_attention_backward': triton_backend._backward_impl,
             'flatten_mm::triton_local_conv_add': triton_conv._add_impl,
             'flatten_mm::triton_local_conv_add_backward': triton_conv._backward_impl,
             'flatten_mm::triton_attention_local': triton_fused._forward_impl,
             'flatten_mm::triton_attention_local_backward': triton_fused._backward_impl}
    launches = []

    def record(name: str, kernel: Any, grid: Any, args: tuple, kwargs: dict) -> None:
        launches.append(('triton::' + name.strip('_').removesuffix('_kernel'),
                         launch_bytes(python_function(kernel), args, kwargs)))
    modules = kernel_modules()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(modules[0], '_properties',
                                              lambda device: SM90_PROPERTIES))
        for module in modules:
            # the GPU's tiling also where the kernels were loaded for the interpreter
            stack.enter_context(mock.patch.object(module, 'INTERPRETED', False))
        stack.enter_context(launches_recorded(record))

        def counted(impl: Callable) -> Callable:
            def run(*args, **kwargs) -> list:
                try:
                    impl.__wrapped__(*args, **kwargs)  # the op's code, not its device checks
                    return list(launches)
                finally:
                    launches.clear()
            return run
        yield {op: counted(impl) for op, impl in impls.items()}
