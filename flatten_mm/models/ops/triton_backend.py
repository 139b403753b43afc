"""The ``'triton'`` backend of the attention core: fused Triton kernels, forward
and backward, as two ``torch.library`` custom ops.

Registered in :mod:`.dispatch` only when ``triton`` is installed; ``'auto'`` picks it
for CUDA tensors in fp16, bf16 or fp32 on GPUs of sm_80 and later. On CPU tensors it runs only under
Triton's interpreter, which is how the tests run it: ``TRITON_INTERPRET=1``
must be set before triton is first imported (torch's custom-op machinery
imports it, so before ``torch``), since triton's own library functions are
decorated then. The kernels (:mod:`.triton_kernels`) are imported on the first
call, not with the package.

Kernel design (notation of :mod:`.triton_kernels`). The work is a few sweeps over
the tokens, each reading the raw q, k, v (any dtype) and applying the focused
mapping on load, so no mapped copy of q or k is ever written:

1. *Row statistics* (one program per few rows): the mapping normalises over all
   C channels, across heads, so the per-head kernels cannot see a whole row.
   One pass per row stores its max m, c = |a| / |u| and t = |u| in fp32 (12
   bytes per token); with them every later kernel maps a head's d channels alone.
   Raising a / m (in (0, 1]) instead of a to the power keeps u in [0, 1] with
   its largest element 1: no overflow or 0 / 0 for any p. With one head (PVT)
   the token kernels below see whole rows, so they compute and store these
   statistics themselves and this pass (a read of q and k) is skipped.
2. *State* (program per image, head and chunk of keys): phi(k) (masked keys
   zeroed) times v summed over the chunk's blocks with ``tl.dot`` (tensor cores,
   fp32 accumulators), plus sum phi(k). Stage 1 has tens
   of thousands of keys per image and a few heads, so the key axis is split into
   chunks that fill the GPU; their d x d partials are added in order by one
   small kernel (deterministic, unlike atomics), which divides by the real key
   count (1 / n a scalar without a mask; with one, counted there).
3. *Output* (program per image, head and block of queries): u of the queries,
   u KV by ``tl.dot``, the normaliser c / (c u . km + eps) and the product, fused;
   only out is written.

Backward has the torch backend's closed form (derivation in autograd.py and in
``_map_backward``), in four sweeps: the gradient of a row's c sums over heads,
so each side has a pass computing per-(row, head) shares of it (stored as
(B, L, h) fp32, small) before a pass that completes the rows:

1. queries: partial gradients of KV and km per chunk (summed as the forward's
   partials), c's shares;
2. queries: dq and the partial gradient of the scale (u's gradient recomputed:
   one d x d product, cheaper than a (B, N, C) fp32 buffer);
3. keys: dv and c's shares;
4. keys: dk and the partial gradient of the scale (both sides' partials,
   chunk-major in one buffer, added by one torch sum).

The op takes the layer's raw ``scale`` parameter: a one-program kernel makes
s_inv = 1 / softplus(scale) for the others (where torch made it with two ops),
and the passes that write the scale's partial gradients take them through
s_inv and softplus there, so no op outside the kernels takes the gradient on
to the scale (four ops a layer before).

With one head a row's c has one share, its own: passes 3 and 4 are one pass,
and on sm_90 to sm_110 so are 1 and 2 (q, g, k and v read once each; on GPUs
with only the warp-level MMA, sm_80-89 and sm_120-121, that fused query pass spills
registers: ``triton_kernels.fuses_query_passes``).

Precision: statistics, normalisers, states and accumulators are fp32; only the
dots' operands are narrowed. bf16 inputs take bf16 operands (u, phi, the states
cast; tensor cores at full rate, fp32's exponent range). fp16 inputs take tf32
dots: fp16's 10-bit mantissa without its range, which u^p (large p) and the
states' gradients (up to 1 / eps where u . km is tiny) leave; a dot costs
about 2d flops per element moved, which at d <= 64 tf32 tensor cores still
outpace memory traffic. fp32 inputs take exact fp32 dots unless torch's matmul
precision allows TF32 (:func:`.dispatch.exact_fp32`).

Tiling (:func:`.triton_kernels.plan`): eight warps per program, token blocks of
4096 / d_padded tokens (128 at d = 32, 64 at d = 64), so a block, a d x d state
and the mapping's temporaries fit the registers.
Head widths up to :data:`MAX_HEAD_DIM`, padded to a power of two >= 16 for
``tl.dot``; ``'auto'`` sends wider heads to the torch backend.
"""
import contextlib
import functools
import importlib.util
import os
import warnings
from types import ModuleType
from typing import Any, Callable, ContextManager, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .dispatch import (_torch_backend, exact_fp32, get_backend, register_backend,
                       register_op_pair)

# registered when triton is installed; imported on the first call only, so
# processes that never run it on CUDA (CPU training, tests under the
# interpreter switched on later) do not import it with flatten_mm
AVAILABLE = importlib.util.find_spec('triton') is not None

MAX_HEAD_DIM = 128  # d x d fp32 states per program: wider heads would spill registers
# Exact fp32 dots run on CUDA cores with both operands in registers: past 64
# channels they spill (ptxas for sm_90: 3.8 KB per thread in the output kernel
# at d = 128), so 'auto' sends such heads to the torch backend (cuBLAS).
MAX_EXACT_HEAD_DIM = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Triton's supported GPUs, and the first with the bf16 and tf32 tensor-core dots
# the kernels are built on; 'auto' keeps older ones (V100, T4) on the torch backend
MIN_CAPABILITY = (8, 0)
_KERNELS = {}


def lazy_module(state: dict, name: str) -> ModuleType:
    """Module ``name`` of this package, imported on first use and kept in ``state``
    (see the module docstring: the interpreter switch is read at import)."""
    if 'module' not in state:
        state['module'] = importlib.import_module(f'.{name}', __package__)
    return state['module']


def kernels() -> ModuleType:
    """The attention kernels module, imported on first use."""
    return lazy_module(_KERNELS, 'triton_kernels')


@torch.compiler.assume_constant_result
def _importable_when_traced() -> bool:
    """:func:`importable` as a torch.compile trace sees it: the answer so far
    (whether triton is installed, until an eager call knew better), taken as a
    constant. Read as a dict lookup, it made dynamo guard on the dict, and an
    eager call after compiling (a validation step) recompiled every graph."""
    return _KERNELS.get('importable', AVAILABLE)


def importable() -> bool:
    """Whether the kernels import here (triton present and working); asked once,
    by an eager call: inside a torch.compile trace an import would break the
    graph (see :func:`_importable_when_traced`). A graph keeps the answer it was
    traced with."""
    if torch.compiler.is_compiling():
        return _importable_when_traced()
    if 'importable' not in _KERNELS:
        try:
            kernels()
            _KERNELS['importable'] = True
        except Exception:  # a broken triton: 'auto' keeps to the torch backend
            _KERNELS['importable'] = False
    return _KERNELS['importable']


_GPUS = {}  # CUDA device index -> whether the kernels are built for it


@torch.compiler.assume_constant_result
def gpu_supported(index: Optional[int]) -> bool:
    """Whether CUDA device ``index`` (None: the current one) has compute
    capability :data:`MIN_CAPABILITY` or later; asked once a device. Before
    sm_80 (V100, T4) triton has no bf16 or tf32 tensor-core dot: built for
    sm_75, no kernel has a tensor-core instruction and the bf16 state and output
    kernels spill 116-516 bytes a thread (``kernel_resources.py --arch 75``),
    where the torch backend runs cuBLAS. A forced ``'triton'`` still runs there.
    True without CUDA (the interpreter; fake CUDA tensors, traced as for the
    GPUs the kernels are built for). A constant to torch.compile: the query runs
    while tracing, outside the graph, which keeps the answer."""
    if index not in _GPUS:
        cap = _capability(index)
        _GPUS[index] = cap is None or cap >= MIN_CAPABILITY
    return _GPUS[index]


# Off for users. Where it is on, 'auto' also takes the kernels for CPU tensors in
# eager mode when they run under Triton's interpreter (thousands of times slower
# than the CPU path): a GPU's choices, first-use check included, without a GPU
# (tests; fuzz_backbones.py --backend auto-interpreted).
INTERPRETER_AS_GPU = {'on': False}


def auto_runs_on(device: torch.device) -> bool:
    """Whether ``'auto'`` may take the Triton ops (attention and the fused DWC) for
    tensors on ``device``: CUDA ones where the kernels import (:func:`importable`)
    and are built for that GPU (:func:`gpu_supported`); CPU ones only under
    :data:`INTERPRETER_AS_GPU`."""
    if device.type != 'cuda':  # (a compiled graph reads no switch: no guard on it)
        return not torch.compiler.is_compiling() and INTERPRETER_AS_GPU['on'] and \
            interpreted() and importable()
    return importable() and gpu_supported(device.index)


def _capability(index: Optional[int]) -> Optional[Tuple[int, int]]:
    """Compute capability of CUDA device ``index`` (None: the current one);
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(
        index if index is not None else torch.cuda.current_device())


def interpreted() -> bool:
    """Whether the kernels run under Triton's CPU interpreter."""
    if 'module' in _KERNELS:
        return _KERNELS['module'].INTERPRETED
    return os.environ.get('TRITON_INTERPRET', '0') == '1'


def channel_rows(x: Tensor) -> Tensor:
    """x with unit channel stride (the kernels take any batch and token strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def on_device(device: torch.device) -> ContextManager:
    """``device`` made the current CUDA device while kernels launch on its
    tensors: Triton launches on the current device and its stream, which need
    not be the tensors' (a model on cuda:1 in a process whose current device is
    0 would have its kernels read another GPU's memory)."""
    return torch.cuda.device(device) if device.type == 'cuda' else contextlib.nullcontext()


def kernel_impl(fn: Callable) -> Callable:
    """A Triton op's implementation, whose first argument is a tensor on the
    device of all the others: refused unless the kernels can run there
    (:func:`check_runnable`), and run under :func:`on_device` of it."""
    @functools.wraps(fn)  # the op's schema is read from fn's signature
    def impl(x: Tensor, *args: Any) -> Any:
        check_runnable(x)
        with on_device(x.device):
            return fn(x, *args)
    return impl


@kernel_impl
def _forward_impl(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, focusing_factor: float,
                  num_heads: int, key_mask: Optional[Tensor]
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """out, and the fp32 KV, km, row statistics of q and k, s_inv and (with a key
    mask) each image's 1 / key count that backward takes; ``scale`` the
    layer's raw parameter (C elements, any shape)."""
    q, k, v = (channel_rows(x) for x in (q, k, v))
    return tuple(kernels().forward(q, k, v, scale.reshape(-1).contiguous(), focusing_factor,
                                   num_heads, key_mask))


def _forward_fake(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, focusing_factor: float,
                  num_heads: int, key_mask: Optional[Tensor]
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, N, C = q.shape
    n, d = k.shape[1], C // num_heads
    f32 = dict(dtype=torch.float32, device=q.device)
    return (q.new_empty((B, N, C), dtype=v.dtype), q.new_empty((B, num_heads, d, d), **f32),
            q.new_empty((B, num_heads, d), **f32), q.new_empty((3, B, N), **f32),
            q.new_empty((3, B, n), **f32), q.new_empty((C, ), **f32),
            q.new_empty((B if key_mask is not None else 0, ), **f32))


@kernel_impl
def _backward_impl(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: Tensor,
                   s_inv: Tensor, kv: Tensor, km: Tensor, stats_q: Tensor, stats_k: Tensor,
                   inv_count: Tensor, focusing_factor: float, num_heads: int,
                   key_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients for q, k, v and the raw scale (its shape and dtype)."""
    grad_out, q, k, v = (channel_rows(x) for x in (grad_out, q, k, v))
    dq, dk, dv, ds = kernels().backward(grad_out, q, k, v, scale.reshape(-1).contiguous(), s_inv,
                                        kv, km, stats_q, stats_k, inv_count, focusing_factor,
                                        num_heads, key_mask)
    return dq, dk, dv, ds.view(scale.shape).to(scale.dtype)


def _backward_fake(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: Tensor,
                   s_inv: Tensor, kv: Tensor, km: Tensor, stats_q: Tensor, stats_k: Tensor,
                   inv_count: Tensor, focusing_factor: float, num_heads: int,
                   key_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            scale.new_empty(scale.shape))


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, scale, focusing_factor, num_heads, key_mask = inputs
    _, kv, km, stats_q, stats_k, s_inv, inv_count = output
    ctx.save_for_backward(q, k, v, scale, s_inv, kv, km, stats_q, stats_k, inv_count, key_mask)
    ctx.focusing_factor, ctx.num_heads = focusing_factor, num_heads
    ctx.mark_non_differentiable(kv, km, stats_q, stats_k, s_inv, inv_count)
    # their gradients stay None: no zero-filled tensors made for each backward
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_out: Optional[Tensor], *_: Optional[Tensor]) -> tuple:
    """Autograd formula of the forward op: the backward op (the states' and
    statistics' gradients are ignored: they are non-differentiable outputs)."""
    if grad_out is None:  # out's gradient is undefined: nothing flows back
        return (None, ) * 7
    q, k, v, scale, s_inv, kv, km, stats_q, stats_k, inv_count, key_mask = ctx.saved_tensors
    grads = torch.ops.flatten_mm.triton_focused_attention_backward(
        grad_out, q, k, v, scale, s_inv, kv, km, stats_q, stats_k, inv_count,
        ctx.focusing_factor, ctx.num_heads, key_mask)
    return tuple(grads) + (None, None, None)


def _register_ops() -> None:
    """flatten_mm::triton_focused_attention and its ``_backward`` (ops named
    ``triton_attention`` before took 1 / softplus(scale), not the scale: a new
    schema, a new name, :func:`.dispatch.register_op_pair`)."""
    register_op_pair('triton_focused_attention', (_forward_impl, _forward_fake),
                     (_backward_impl, _backward_fake), (_backward, _setup_context))


def check_runnable(x: Tensor) -> None:
    """Raise unless the kernels can run on x's device: CUDA, or the interpreter."""
    if x.device.type != 'cuda' and not interpreted():
        raise RuntimeError(
            f"the 'triton' backend's kernels run on CUDA tensors, got a tensor on "
            f"{x.device.type!r}; on CPU it needs Triton's interpreter: set TRITON_INTERPRET=1 "
            f"before its first call")


def check_dtypes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """The kernels' dtypes (the dispatcher checks the rest of a call:
    :func:`.dispatch.check_call`)."""
    for name, x in (('q', q), ('k', k), ('v', v)):
        if x.dtype not in DTYPES:
            raise ValueError(f"the 'triton' attention backend takes {DTYPES}, got {name} in "
                             f'{x.dtype}')


def check_head_dim(C: int, num_heads: int) -> None:
    """ValueError unless the heads are at most :data:`MAX_HEAD_DIM` wide."""
    d = C // num_heads
    if d > MAX_HEAD_DIM:
        raise ValueError(f"the 'triton' attention backend takes head widths up to "
                         f'{MAX_HEAD_DIM}, got d={d} (C={C}, num_heads={num_heads})')


def triton_backend(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, focusing_factor: float,
                   num_heads: int, key_mask: Optional[Tensor] = None,
                   overwrite_qk: bool = False) -> Tensor:
    """The backend (:func:`.dispatch.focused_linear_attention`'s signature): one
    forward op, taking the raw ``scale`` (the kernels make 1 / softplus of it,
    and its gradient). ``overwrite_qk`` is moot (q and k are only read)."""
    check_dtypes(q, k, v)
    check_head_dim(q.shape[-1], num_heads)
    return run_guarded(
        _KERNELS, 'attention backend',
        lambda: _kernels_op(q, k, v, scale, focusing_factor, num_heads, key_mask),
        lambda: _agrees_on_first_use(q, k, v, scale, focusing_factor, num_heads, key_mask),
        lambda: _torch_backend(q, k, v, scale, focusing_factor, num_heads, key_mask,
                               overwrite_qk))


def run_guarded(state: dict, what: str, ours, agrees, theirs) -> Tensor:
    """``ours()`` (a Triton op's call), or ``theirs()`` (its PyTorch form) when
    ``agrees()`` (its first-use check) says it is wrong or it fails on its first
    call (:func:`fall_back_on_first_failure`; ``state`` records that it ran).
    The check comes first: a call returns the output of the one form it ran, so
    a block under gradient checkpointing (``with_cp``) saves in its forward the
    tensors of the form its recomputation runs (after a disagreement, 'auto'
    takes the torch backend there)."""
    if not agrees():
        return theirs()
    try:
        out = ours()
    except Exception as err:  # noqa: BLE001 (re-raised unless it is the first call)
        if not fall_back_on_first_failure(err, state.get('ran', False), what):
            raise
        return theirs()
    if not torch.compiler.is_compiling():  # no side effect in a traced graph
        state['ran'] = True
    return out


def _kernels_op(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, focusing_factor: float,
                num_heads: int, key_mask: Optional[Tensor] = None) -> Tensor:
    """The forward op's output."""
    return torch.ops.flatten_mm.triton_focused_attention(q, k, v, scale, float(focusing_factor),
                                                         int(num_heads), key_mask)[0]


# How far the kernels may be from the torch backend on the first-use check:
# several times the tests' bounds against float64 (test_triton.py), far below
# the O(1) of a wrong kernel. The attention kernels in fp32 where torch allows
# TF32 take fp16's bound: both sides' dots then round their operands to fp16's
# 10-bit mantissa, each in its own order (agree_tol).
AGREE_TOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 8e-2}
_AGREED = set()


def agree_tol(dtype: torch.dtype) -> float:
    """The attention check's bound for inputs of ``dtype`` (:data:`AGREE_TOL`;
    the conv kernels have no dots: theirs is the dtype's own)."""
    tf32 = dtype == torch.float32 and not exact_fp32(dtype)
    return AGREE_TOL[torch.float16 if tf32 else dtype]


def _probe(fn, inputs: Sequence[Tensor]) -> list:
    """Output and input gradients of ``fn`` on detached copies of ``inputs``, for
    a fixed output gradient (no random numbers drawn); under
    ``torch.inference_mode`` (no gradients) the output alone. Its graph keeps
    its tensors itself, whatever saved-tensor hooks are in force: in the forward
    of a block under gradient checkpointing (``with_cp``) the checkpoint's
    hooks would count them as the block's, recompute the block to read them
    back, and find other tensors saved when the backward recomputes it."""
    if torch.is_inference_mode_enabled():
        return [fn(*inputs)]
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_itself, _itself):
        out = fn(*leaves)
        g = torch.cos(torch.arange(out.numel(), device=out.device, dtype=torch.float32))
        grads = torch.autograd.grad(out, leaves, g.view_as(out).to(out.dtype))
    return [out.detach(), *grads]


def _itself(x: Tensor) -> Tensor:
    """A saved-tensor hook that keeps the tensor as it is."""
    return x


def _record(key: tuple) -> tuple:
    """The entry of :data:`_AGREED` a check of ``key`` makes now: a check under
    ``torch.inference_mode`` covers the forward only."""
    return key + ('forward', ) if torch.is_inference_mode_enabled() else key


def reset_first_use() -> None:
    """Forget which configurations were checked and any fallback to the torch
    backend: under ``'auto'`` the next call of each configuration is checked
    again (tests; fuzz_backbones.py checks the check in every case)."""
    _AGREED.clear()
    _KERNELS.pop('importable', None)


def settled(key: tuple) -> bool:
    """Whether a call of configuration ``key`` needs no first-use check: not
    ``'auto'``, inside a compiled graph, or already checked (in training, with
    gradients; under ``torch.inference_mode``, at least forward)."""
    return (get_backend() != 'auto' or torch.compiler.is_compiling() or key in _AGREED or
            _record(key) in _AGREED)


def agrees_once(key: tuple, ours, theirs, inputs: Sequence[Tensor], names: Sequence[str],
                what: str, config: str, tol: Optional[float] = None) -> bool:
    """Under ``'auto'``, in eager mode, the first call of each configuration ``key``
    of a Triton op ``ours`` is checked against its PyTorch form ``theirs`` on
    ``inputs`` (the call's first images; ``names`` names the output and them,
    ``what`` and ``config`` name the op and the configuration in the warning):
    output and every input's gradient, each within ``tol`` (default
    :data:`AGREE_TOL` of the inputs' dtype; relative norm). Under
    ``torch.inference_mode``, which allows no gradient, the output alone, and
    the gradients at the first call outside it. On a disagreement (a GPU,
    driver or Triton on which the kernels compute wrong) it warns with the
    errors, sends this process to the torch backend and returns False: a wrong
    kernel is never silent. So does a kernel that fails in the check (a
    backward kernel is built there first). A forced ``'triton'`` is not checked."""
    if settled(key):
        return True
    try:
        ours_out = _probe(ours, inputs)  # its backward's first build and run, too
    except (torch.OutOfMemoryError, ValueError):
        raise  # not a kernel that cannot be built: the caller's error
    except Exception as err:  # noqa: BLE001 (a backward kernel that cannot be built)
        _leave_for_torch(f"the 'triton' {what} failed on their first check ({err!r})")
        return False
    errors = {name: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
              for name, a, b in zip(names, ours_out, _probe(theirs, inputs))}
    tol = AGREE_TOL[inputs[1].dtype] if tol is None else tol
    if max(errors.values()) <= tol:
        _AGREED.add(_record(key))
        return True
    found = ', '.join(f'{name} {err:.1e}' for name, err in errors.items())
    _leave_for_torch(f"the 'triton' {what} disagree with the 'torch' backend on "
                     f'{inputs[1].device} ({inputs[1].dtype}, {config}): relative errors '
                     f'{found}, allowed {tol:.0e}; please report it with your GPU, driver and '
                     'triton versions')
    return False


def _agrees_on_first_use(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, p: float, h: int,
                         key_mask: Optional[Tensor]) -> bool:
    """:func:`agrees_once` for the attention kernels: a configuration is the
    device, dtype, head width, one head or several, whether a key mask is given,
    for fp32 whether the dots are exact (other kernels: their precision and
    token blocks, :func:`.triton_kernels.plan`), and the dtype of the scale the
    kernels read."""
    key = ('attention', q.device, q.dtype, q.shape[-1] // h, h == 1, key_mask is not None,
           exact_fp32(q.dtype), scale.dtype)
    if settled(key):  # before the key count's sync
        return True
    keys = k.shape[1] if key_mask is None else int(key_mask[0].sum())  # one sync, until agreed
    if keys < 2:  # one key: q's and k's gradients are eps-sized noise, no test
        return True
    mask = None if key_mask is None else key_mask[:1]
    return agrees_once(key, lambda *t: _kernels_op(*t, p, h, mask),
                       lambda *t: _torch_backend(*t, p, h, mask, False),
                       (q[:1], k[:1], v[:1], scale), ('out', 'q', 'k', 'v', 'scale'),
                       'attention kernels', f'head width {key[3]}, {h} heads',
                       tol=agree_tol(q.dtype))


def fall_back_on_first_failure(err: Exception, ran: bool, what: str) -> bool:
    """Under ``'auto'``, in eager mode, when the kernels of ``what`` fail on their
    first call (a Triton or driver that cannot build them; ``ran``: they have
    run before): warn once, leave this backend for the torch backend in this
    process, and return True. A forced ``'triton'``, a failure after a successful
    call or one inside a compiled graph is the caller's error (False)."""
    if get_backend() != 'auto' or ran or torch.compiler.is_compiling() \
            or isinstance(err, (torch.OutOfMemoryError, ValueError)):
        return False  # not a kernel that cannot be built: the caller's error
    _leave_for_torch(f"the 'triton' {what} failed on its first call ({err!r})")
    return True


LEFT_FOR_TORCH = "this process uses the 'torch' backend instead"  # in every such warning


def _leave_for_torch(reason: str) -> None:
    """Warn with ``reason`` and make ``'auto'`` take the torch backend for the
    rest of the process (``supports()`` answers False from now on)."""
    _KERNELS['importable'] = False
    warnings.warn(f'{reason}; {LEFT_FOR_TORCH} (set FLATTEN_MM_ATTN_BACKEND=torch to choose '
                  'it and silence this)', RuntimeWarning, stacklevel=4)


def auto_head_dim(dtype: torch.dtype) -> int:
    """The widest head ``'auto'`` sends to the kernels for inputs of ``dtype``."""
    return MAX_EXACT_HEAD_DIM if exact_fp32(dtype) else MAX_HEAD_DIM


def supports(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
             num_heads: int) -> bool:
    """``'auto'`` takes this backend for tensors of one supported dtype and
    heads up to :data:`MAX_HEAD_DIM` channels (:data:`MAX_EXACT_HEAD_DIM` for
    fp32 without TF32) where :func:`auto_runs_on` their device (CUDA). Shapes, heads
    dividing C and the mask's dtype the dispatcher has checked
    (:func:`.dispatch.check_call`)."""
    # the device first: on CPU every call ends there, before auto_head_dim reads
    # torch's TF32 setting
    return (auto_runs_on(q.device) and v.dtype in DTYPES and q.dtype == k.dtype == v.dtype
            and q.shape[-1] // num_heads <= auto_head_dim(v.dtype))


if AVAILABLE:
    _register_ops()
    register_backend('triton', triton_backend, auto=supports)
