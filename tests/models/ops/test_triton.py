"""The 'triton' backend of the attention core against the reference formula.

Without CUDA the kernels run under Triton's CPU interpreter (conftest.py), so the
shapes are tiny; the interpreter tiles by 16 tokens, two blocks per program, so
N = 37 crosses block and chunk borders. Errors are measured as
``||x - ref||_F / ||ref||_F`` over the whole tensor, the reference in float64
on the same (rounded) inputs.

Tolerances: fp32 1e-4. Half precision stores q, k, v, out and the gradients in
16 bits, and on CUDA narrows the dot operands (u, phi, the states) to bf16, or
to tf32 for fp16 inputs (fp16's mantissa): each rounding costs at most one unit
roundoff (fp16 2^-11 ~ 4.9e-4, bf16 2^-8 ~ 3.9e-3), and a gradient passes
through a few of them, so fp16 is held to 5e-3 and bf16 to 3e-2 (about ten
units; a wrong formula is off by O(1)). Under the interpreter the dots of
both run on fp32 operands (tl.dot on bf16 is wrong there).

A single key makes the gradients of q and k eps-sized differences, which no fp32
backend resolves to 1e-4: the cases keep at least two keys.
"""
import pytest
import torch
import torch.nn.functional as F

from backbone_checks import OpLog
from flatten_mm.models.ops import available_backends, focused_linear_attention, use_backend
from flatten_mm.models.ops import triton_backend as tb

pytestmark = pytest.mark.skipif(not tb.AVAILABLE, reason='triton does not import')

if tb.AVAILABLE:
    import triton
    import triton.language as tl

    from flatten_mm.models.ops import triton_kernels as tk  # under conftest's interpreter switch

    @triton.jit
    def _inverse_scale_probe(scale_ptr, s_inv_ptr, grad_ptr, n, BLOCK: tl.constexpr):
        """s_inv and ds_inv / dx of n raw scales x, by the kernels' own function."""
        offs = tl.arange(0, BLOCK)
        s_inv, grad = tk._inverse_scale(scale_ptr, offs, offs < n)
        tl.store(s_inv_ptr + offs, s_inv, mask=offs < n)
        tl.store(grad_ptr + offs, grad, mask=offs < n)

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
NAMES = ('out', 'q', 'k', 'v', 'scale')


def inputs(B, N, n, C, dtype, masked=False, device=DEVICE):
    """q, k, v (rounded to dtype), scale (fp32), key mask, output gradient."""
    q = torch.randn(B, N, C, device=device).to(dtype)
    k = torch.randn(B, n, C, device=device).to(dtype)
    v = torch.randn(B, n, C, device=device).to(dtype)
    scale = (0.5 * torch.randn(1, 1, C, device=device))
    mask = None
    if masked:  # padded tail keys, as a padded window, and a few random holes
        mask = torch.rand(B, n, device=device) > 0.2
        mask[:, -(n // 4 + 1):] = False
        mask[:, 0] = True
    g = torch.randn(B, N, C, device=device)
    return q, k, v, scale, mask, g


def run(backend, q, k, v, scale, p, h, mask, g, dtype=None):
    """Output and gradients for q, k, v and scale of one backend (inputs cast to dtype)."""
    ts = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    s = scale.detach().to(dtype or scale.dtype).requires_grad_()
    with use_backend(backend):
        out = focused_linear_attention(ts[0], ts[1], ts[2], s, p, h, mask)
    return [out] + list(torch.autograd.grad(out, ts + [s], g.to(out.dtype)))


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def check(dtype, B, N, n, C, h, p, masked, tol=None):
    q, k, v, scale, mask, g = inputs(B, N, n, C, dtype, masked)
    got = run('triton', q, k, v, scale, p, h, mask, g)
    ref = run('reference', q, k, v, scale, p, h, mask, g, torch.float64)
    assert got[0].dtype == dtype and got[0].shape == (B, N, C)
    for name, x, r in zip(NAMES, got, ref):
        assert x.shape == r.shape, name
        assert torch.isfinite(x).all(), name
        err = rel_err(x, r)
        assert err < (tol or TOL[dtype]), f'{name}: relative error {err:.2e}'


@pytest.mark.parametrize('B,N,n,C,h,p,masked', [
    (2, 37, 37, 64, 2, 3.0, True),  # key mask with padded keys, batch 2, d = 32
    (2, 37, 10, 48, 2, 3.0, False),  # reduced keys (n != N), d = 24
    (1, 37, 37, 32, 1, 1.0, False),  # one head, p = 1
    (2, 37, 10, 32, 1, 3.0, True),  # one head (fused backward), reduced and masked keys
    (2, 21, 21, 24, 1, 50.0, True),  # p = 50: finite and equal
    (1, 37, 9, 96, 3, 3.0, True),  # three heads, reduced and masked keys
    (1, 5, 3, 8, 2, 2.0, False),  # d = 4: padded far up to 16
    (3, 1, 2, 16, 2, 3.0, False),  # one query (one key: q, k get only eps-sized gradients)
])
def test_fp32_matches_reference(B, N, n, C, h, p, masked):
    check(torch.float32, B, N, n, C, h, p, masked)


@pytest.mark.parametrize('B,N,n,C,h,p,masked', [
    (2, 37, 37, 64, 2, 3.0, True),
    (1, 37, 10, 24, 1, 50.0, False),
])
def test_fp16_matches_reference(B, N, n, C, h, p, masked):
    check(torch.float16, B, N, n, C, h, p, masked)


def test_bf16_matches_reference():
    # under the interpreter bf16 loads and stores, fp32 dot operands (tl.dot on
    # bf16 is wrong there); on CUDA the real bf16 dots
    check(torch.bfloat16, 2, 37, 37, 64, 2, 3.0, True)


def test_strided_views_of_one_projection():
    """q, k, v as column slices of one (B, N, 3C) projection (the layers' qkv):
    read in place through their strides; gradients as the reference's."""
    B, N, C, h = 2, 21, 32, 2
    qkv = torch.randn(B, N, 3 * C, device=DEVICE)
    scale = 0.5 * torch.randn(1, 1, C, device=DEVICE)
    g = torch.randn(B, N, C, device=DEVICE)
    results = []
    for backend, dtype in (('triton', torch.float32), ('reference', torch.float64)):
        x = qkv.detach().to(dtype).requires_grad_()
        s = scale.detach().to(dtype).requires_grad_()
        q, k, v = x.split(C, dim=-1)
        with use_backend(backend):
            out = focused_linear_attention(q, k, v, s, 3.0, h, overwrite_qk=True)
        results.append([out] + list(torch.autograd.grad(out, (x, s), g.to(dtype))))
        assert torch.equal(x.detach().to(torch.float32), qkv)  # q and k only read
    for name, got, ref in zip(('out', 'qkv', 'scale'), *results):
        assert rel_err(got, ref) < TOL[torch.float32], name


def test_registered_and_not_auto_on_cpu(monkeypatch):
    """'auto' never sends CPU tensors to the kernels, but where the interpreter
    stands in for a GPU (tb.INTERPRETER_AS_GPU, tests and fuzz_backbones.py):
    then in eager mode under the interpreter, with the GPU's dtype and head limits."""
    assert 'triton' in available_backends()
    q, k, v, *_ = inputs(1, 4, 4, 8, torch.float32, device='cpu')
    assert not tb.supports(q, k, v, None, 2)
    monkeypatch.setitem(tb.INTERPRETER_AS_GPU, 'on', True)
    assert tb.supports(q, k, v, None, 2) == tb.interpreted()
    monkeypatch.setattr(tb, 'interpreted', lambda: True)
    assert tb.supports(q, k, v, None, 2) and not tb.supports(q.double(), k, v, None, 2)
    wide = torch.zeros(1, 4, 2 * (tb.MAX_EXACT_HEAD_DIM + 1))
    assert not tb.supports(wide, wide, wide, None, 2)  # (exact fp32 on CPU)
    compiled = torch.compile(lambda t: t + tb.supports(t, t, t, None, 2), fullgraph=True,
                             backend='eager')
    assert compiled(q).equal(q)  # not taken inside a compiled graph
    monkeypatch.setattr(tb, 'interpreted', lambda: False)
    assert not tb.supports(q, k, v, None, 2)


def test_clear_errors(monkeypatch):
    q, k, v, scale, _, _ = inputs(1, 5, 5, 8, torch.float32, device='cpu')
    with use_backend('triton'):
        with pytest.raises(ValueError, match='num_heads'):
            focused_linear_attention(q, k, v, scale, 3.0, 3)
        with pytest.raises(ValueError, match='float64'):
            focused_linear_attention(q.double(), k, v, scale, 3.0, 2)
        with pytest.raises(ValueError, match='key_mask'):
            focused_linear_attention(q, k, v, scale, 3.0, 2, torch.ones(1, 4, dtype=torch.bool))
        big = torch.zeros(1, 2, 2 * (tb.MAX_HEAD_DIM + 1))
        with pytest.raises(ValueError, match=f'd={tb.MAX_HEAD_DIM + 1}'):
            focused_linear_attention(big, big, big, big[0, 0], 3.0, 2)
        monkeypatch.setattr(tb, 'interpreted', lambda: False)
        with pytest.raises(RuntimeError, match='TRITON_INTERPRET'):
            focused_linear_attention(q, k, v, scale, 3.0, 2)


def test_auto_falls_back_when_the_first_call_fails(monkeypatch):
    """Under 'auto' a kernel that cannot run (a Triton that cannot build it)
    leaves the backend for the torch one with a warning: at its configuration's
    first-use check, which runs before the op, or where no check runs (a single
    key) at its first call; after a successful call it raises, as a forced
    'triton' does, and so does running out of memory."""
    q, k, v, scale, _, _ = inputs(1, 5, 5, 8, torch.float32, device='cpu')
    want = focused_linear_attention(q, k, v, scale, 3.0, 2)  # 'auto' on CPU: torch
    one_key = focused_linear_attention(q, k[:, :1], v[:, :1], scale, 3.0, 2)

    def broken(*args):
        raise RuntimeError('cannot build the kernel')
    monkeypatch.setattr(tb.kernels(), 'forward', broken)
    monkeypatch.setattr(tb, '_AGREED', set())
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    monkeypatch.delitem(tb._KERNELS, 'ran', raising=False)
    with use_backend('triton'), pytest.raises(RuntimeError, match='cannot build'):
        focused_linear_attention(q, k, v, scale, 3.0, 2)
    with pytest.warns(RuntimeWarning, match="first check .*cannot build.*'torch' backend"):
        got = tb.triton_backend(q, k, v, scale, 3.0, 2)  # as 'auto' would call it
    torch.testing.assert_close(got, want)
    assert tb._KERNELS['importable'] is False  # 'auto' no longer picks it
    assert 'ran' not in tb._KERNELS  # the check failed: the op itself did not run
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    with pytest.warns(RuntimeWarning, match="first call .*cannot build.*'torch' backend"):
        got = tb.triton_backend(q, k[:, :1], v[:, :1], scale, 3.0, 2)  # one key: no check
    torch.testing.assert_close(got, one_key)
    assert tb._KERNELS['importable'] is False
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    monkeypatch.setitem(tb._KERNELS, 'ran', True)  # after a successful call: the error
    with pytest.raises(RuntimeError, match='cannot build'):
        tb.triton_backend(q, k[:, :1], v[:, :1], scale, 3.0, 2)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError('no memory')
    monkeypatch.setattr(tb.kernels(), 'forward', out_of_memory)
    monkeypatch.delitem(tb._KERNELS, 'ran')  # a first call again: memory is no reason to leave
    for keys in (5, 1):  # in the check, and in a first call without one
        with pytest.raises(torch.OutOfMemoryError):
            tb.triton_backend(q, k[:, :keys], v[:, :keys], scale, 3.0, 2)
    assert tb._KERNELS['importable'] is True


def recording_backend():
    """(graphs, a torch.compile backend that keeps each graph it is given and runs
    it as traced)."""
    graphs = []

    def backend(gm, _):
        graphs.append(gm)
        return gm.forward
    return graphs, backend


def test_auto_choice_compiles_without_importing(monkeypatch):
    """Whether the kernels import is settled by an eager call, never inside a
    trace (an import there would break a fullgraph compile); the eager answer
    arriving later recompiles nothing (a validation step between compiled
    training steps once recompiled every graph)."""
    monkeypatch.setattr(tb, '_KERNELS', {})
    graphs, backend = recording_backend()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + 1 if tb.importable() else x - 1, fullgraph=True,
                       backend=backend)
    assert torch.equal(fn(torch.zeros(2)), torch.ones(2) if tb.AVAILABLE else -torch.ones(2))
    assert 'importable' not in tb._KERNELS and 'module' not in tb._KERNELS
    assert tb.importable() is True and tb._KERNELS['importable'] is True
    assert torch.equal(fn(torch.zeros(2)), torch.ones(2)) and len(graphs) == 1


def op_args(masked):
    q, k, v, scale, mask, _ = inputs(2, 9, 5, 16, torch.float32, masked)
    return [t.requires_grad_() for t in (q, k, v, scale)] + [3.0, 2, mask]


def test_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch of both ops
    (with a key mask; compile and export below pass None)."""
    args = op_args(True)
    torch.library.opcheck(torch.ops.flatten_mm.triton_focused_attention.default, args)
    out, *kept = torch.ops.flatten_mm.triton_focused_attention(*args)
    kv, km, stats_q, stats_k, s_inv, inv_count = kept
    assert inv_count.shape == (2, ) and torch.equal(inv_count, 1 / args[-1].sum(1).float())
    g = torch.randn_like(out)
    bwd_args = [g] + [a.detach() if torch.is_tensor(a) else a for a in args[:4]] + \
        [s_inv, kv, km, stats_q, stats_k, inv_count] + args[4:]
    torch.library.opcheck(torch.ops.flatten_mm.triton_focused_attention_backward.default, bwd_args)
    # the key mask's counts are the forward's: a backward given none is refused, not read past
    bad = bwd_args[:10] + [inv_count[:0]] + bwd_args[11:]
    with pytest.raises(ValueError, match=r'inv_count must be \(2,\).*got \(0,\)'):
        torch.ops.flatten_mm.triton_focused_attention_backward(*bad)


def test_compile_fullgraph_one_op_each():
    """torch.compile(fullgraph=True) traces the dispatch call into the forward op, and
    AOT autograd's backward graph into the backward op; results equal eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def record(gm, _):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == 'call_function'})
        return make_boxed_func(gm.forward)

    def f(q, k, v, scale, mask):
        return focused_linear_attention(q, k, v, scale, 3.0, 2, mask) * 2

    q, k, v, scale, mask, g = inputs(2, 19, 7, 48, torch.float32, True)
    torch._dynamo.reset()
    with use_backend('triton'):
        compiled = torch.compile(f, fullgraph=True,
                                 backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        got = run_fn(compiled, q, k, v, scale, mask, g)
        want = run_fn(f, q, k, v, scale, mask, g)
    assert any('flatten_mm.triton_focused_attention.default' in s for s in graphs)
    assert any('flatten_mm.triton_focused_attention_backward.default' in s for s in graphs)
    for name, x, r in zip(NAMES, got, want):
        torch.testing.assert_close(x, r, msg=name)


def run_fn(fn, q, k, v, scale, mask, g):
    ts = [t.detach().clone().requires_grad_() for t in (q, k, v, scale)]
    out = fn(*ts, mask)
    return [out] + list(torch.autograd.grad(out, ts, g))


def test_export():
    class Core(torch.nn.Module):

        def forward(self, q, k, v, scale):
            return focused_linear_attention(q, k, v, scale, 3.0, 2)

    q, k, v, scale, _, _ = inputs(1, 9, 9, 16, torch.float32)
    with use_backend('triton'):
        ep = torch.export.export(Core(), (q, k, v, scale))
        want = Core()(q, k, v, scale)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == 'call_function']
    assert 'flatten_mm.triton_focused_attention.default' in targets
    torch.testing.assert_close(ep.module()(q, k, v, scale), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='needs two GPUs')
def test_runs_on_the_tensors_gpu_not_the_current_one():
    """Inputs on cuda:1 while cuda:0 is current: the kernels launch on cuda:1
    (Triton launches on the current device) and equal the torch backend there."""
    q, k, v, scale, mask, g = inputs(2, 50, 50, 64, torch.float32, True, device='cuda:1')
    with torch.cuda.device(0):
        got = run('triton', q, k, v, scale, 3.0, 2, mask, g)
    want = run('torch', q, k, v, scale, 3.0, 2, mask, g)
    for name, x, r in zip(NAMES, got, want):
        assert x.device == torch.device('cuda', 1) and rel_err(x, r) < 1e-4, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('B,N,n,C,h,masked', [
    (2, 3000, 3000, 96, 3, False),  # Swin/CSwin-like heads, d = 32
    (2, 3000, 3000 // 64, 64, 1, False),  # PVT stage 1: one head, keys reduced 8x8
    (2, 3000, 3000, 64, 2, True),  # padded windows' key mask
])
def test_cuda_bf16_matches_reference(B, N, n, C, h, masked):
    """Real bf16 tensor-core dots on GPU shapes, 3e-2 (module docstring); fp32 exact."""
    check(torch.bfloat16, B, N, n, C, h, 3.0, masked)
    check(torch.float32, B, N, n, C, h, 3.0, masked, tol=1e-4)


def test_plan_fills_the_gpu_it_runs_on(monkeypatch):
    """Outside the interpreter the key sweeps are split into chunks so that the
    (image, head, chunk) programs number a few per multiprocessor of the GPU at
    hand: a GPU with half the multiprocessors gets about half the chunks."""
    kernels = tb.kernels()
    monkeypatch.setattr(kernels, 'INTERPRETED', False)
    bh, tokens = 16 * 3, 66_800  # stage 1 of 800x1333, batch 16, Swin-T's 3 heads
    big = kernels.plan(tokens, bh, 32, torch.bfloat16, sms=132)
    small = kernels.plan(tokens, bh, 32, torch.bfloat16, sms=66)
    assert big.block_n == small.block_n == 128
    assert bh * big.chunks >= 4 * 132 and bh * small.chunks >= 4 * 66
    assert big.chunks == pytest.approx(2 * small.chunks, rel=0.1)
    assert big.chunks * big.blocks_per_prog * big.block_n >= tokens
    assert kernels.sm_count(torch.device('cpu')) == 132


def test_tiles_and_auto_head_widths(monkeypatch):
    """Exact fp32 dots hold both operands in registers: their token blocks shrink
    as heads widen (16 at d = 64, where 32 spilled), and 'auto' keeps heads over
    64 channels on the torch backend unless TF32 is allowed. Backward halves the
    blocks."""
    kernels = tb.kernels()
    monkeypatch.setattr(kernels, 'INTERPRETED', False)
    matmul, tf32 = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        blocks = {d: kernels.plan(4096, 8, d, torch.float32).block_n for d in (16, 32, 64, 128)}
        assert blocks == {16: 64, 32: 32, 64: 16, 128: 16}
        assert kernels.plan(4096, 8, 64, torch.float32).precision == 'ieee'
        assert kernels.plan(4096, 8, 64, torch.bfloat16).block_n == 64
        # backward: half blocks (its passes hold more of them live), as many
        # programs (Swin-T stage 1 of 800x1333, batch 16)
        full = kernels.plan(66_800, 48, 32, torch.bfloat16)
        half = kernels.plan(66_800, 48, 32, torch.bfloat16, backward=True)
        assert (full.block_n, half.block_n) == (128, 64)
        assert half.chunks == full.chunks and abs(half.blocks_per_prog - 2 * full.blocks_per_prog) <= 1
        assert kernels.plan(4096, 8, 64, torch.float32, backward=True).block_n == 16
        assert tb.auto_head_dim(torch.float32) == 64
        assert tb.auto_head_dim(torch.bfloat16) == tb.auto_head_dim(torch.float16) == 128
        matmul.allow_tf32 = True
        assert tb.auto_head_dim(torch.float32) == 128
        assert kernels.plan(4096, 8, 64, torch.float32).block_n == 64
    finally:
        matmul.allow_tf32 = tf32


def test_token_blocks_fit_the_grids_second_axis(monkeypatch):
    """The output and key-value gradient passes put token blocks on the grid's
    second axis, which CUDA caps at 65,535: a longer sweep takes larger blocks
    (a 4096 x 4096 image's 2^20 stage-1 tokens at exact fp32's 16-token
    blocks), and the kernels stay right with them (a cap of 3 blocks under
    the interpreter: 64-token blocks for 100 queries and 70 keys)."""
    kernels = tb.kernels()
    matmul, tf32 = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    with monkeypatch.context() as m:
        m.setattr(kernels, 'INTERPRETED', False)
        try:
            matmul.allow_tf32 = False
            for backward in (False, True):
                big = kernels.plan(2 ** 20, 1, 64, torch.float32, backward=backward)
                assert big.block_n == 32 and 2 ** 20 // 32 <= kernels.MAX_GRID_Y
            assert kernels.plan(2 ** 20 - 16, 1, 64, torch.float32).block_n == 16
        finally:
            matmul.allow_tf32 = tf32
    monkeypatch.setattr(kernels, 'MAX_GRID_Y', 3)
    assert kernels.plan(100, 2, 32, torch.float32).block_n == 64
    grids = []

    class Recorded:  # kernel[grid](...) with the grid kept
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return self.kernel[grid]
    for name in [n for n in vars(kernels) if n.startswith('_') and n.endswith('_kernel')]:
        monkeypatch.setattr(kernels, name, Recorded(getattr(kernels, name)))
    for h, masked in ((2, True), (1, False)):
        q, k, v, scale, mask, g = inputs(2, 100, 70, 64, torch.float32, masked)
        got = run('triton', q, k, v, scale, 3.0, h, mask, g)
        ref = run('reference', q, k, v, scale, 3.0, h, mask, g, torch.float64)
        for name, x, r in zip(NAMES, got, ref):
            assert rel_err(x, r) < TOL[torch.float32], name
    assert len(grids) >= 8 and all(n <= 3 for grid in grids for n in grid[1:]), grids


@pytest.mark.heavy(27)
def test_the_gpus_tilings_compute_the_same(monkeypatch):
    """The interpreter tiles by 16 tokens; the GPU by 128 (d = 32) or 64 (d = 64)
    with TF32 dots, 32 or 16 with exact fp32, in chunks sized for 132
    multiprocessors. Whole layers (three heads; one head with reduced keys;
    two heads with a key mask) run with the GPU's plans for the attention and
    the conv kernels, blocks and chunks crossed, equal the torch backend."""
    from flatten_mm.models import FocusedLinearAttention
    from flatten_mm.models.ops import triton_conv as tc
    for module in (tb.kernels(), tc.kernels()):
        monkeypatch.setattr(module, 'INTERPRETED', False)  # the plans only
    monkeypatch.setattr(tb, 'interpreted', lambda: DEVICE == 'cpu')
    matmul, tf32 = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    try:
        for allow_tf32, blocks in ((True, (128, 64, 128)), (False, (32, 16, 32))):
            matmul.allow_tf32 = allow_tf32
            for (C, h, H, W, sr, masked), block in zip(
                    ((96, 3, 12, 30, 1, False), (64, 1, 20, 20, 2, False),
                     (64, 2, 15, 21, 1, True)), blocks):
                B = 2 if masked else 1
                assert tb.kernels().plan(H * W, B * h, C // h, torch.float32).block_n == block
                found = {}
                for backend in ('triton', 'torch'):
                    torch.manual_seed(0)
                    layer = FocusedLinearAttention(C, h, sr_ratio=sr).to(DEVICE)
                    x = torch.randn(B, H * W, C, device=DEVICE, requires_grad=True)
                    mask = (torch.rand(B, H * W, device=DEVICE) < 0.8) if masked else None
                    with use_backend(backend):
                        out = layer(x, (H, W), mask)
                        out.square().sum().backward()
                    found[backend] = [out.detach(), x.grad, *(p.grad for p in layer.parameters())]
                tol = 1e-5 if DEVICE == 'cpu' or not allow_tf32 else 1e-2
                for ours, theirs in zip(found['triton'], found['torch']):
                    assert rel_err(ours, theirs) < tol, (C, h, allow_tf32)
    finally:
        matmul.allow_tf32 = tf32


def test_exact_fp32_reads_either_tf32_api():
    """torch's new precision API makes reading the legacy flag raise: both are read
    through exact_fp32, which plan and 'auto' share."""
    from flatten_mm.models.ops.dispatch import exact_fp32
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = 'tf32'
        assert not exact_fp32(torch.float32) and tb.auto_head_dim(torch.float32) == 128
        matmul.fp32_precision = 'ieee'
        assert exact_fp32(torch.float32) and tb.auto_head_dim(torch.float32) == 64
        assert not exact_fp32(torch.bfloat16)
    finally:
        matmul.fp32_precision = before


def test_first_use_bound_follows_the_tf32_setting(monkeypatch):
    """fp32 with TF32 allowed has tf32 dots on both sides, each rounding its
    operands to 10 bits in its own order: the attention check takes fp16's
    bound there, fp32's with IEEE dots, and checks each setting's kernels (other
    precision and blocks) apart. Kernels 5e-3 off pass under TF32, not under
    IEEE; the conv kernels (no dots) keep fp32's bound."""
    probes = _auto_first_use(monkeypatch)
    kernels_op = tb._kernels_op
    monkeypatch.setattr(tb, '_kernels_op', lambda *a: kernels_op(*a) * (1 + 5e-3))
    q, k, v, scale, mask, g = inputs(1, 37, 37, 64, torch.float32)
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = 'tf32'
        assert tb.agree_tol(torch.float32) == tb.AGREE_TOL[torch.float16] == 2e-2
        assert tb._agrees_on_first_use(q, k, v, scale, 3.0, 2, None) and len(probes) == 2
        matmul.fp32_precision = 'ieee'
        assert tb.agree_tol(torch.float32) == 1e-3
        assert tb.agree_tol(torch.bfloat16) == 8e-2
        with pytest.warns(RuntimeWarning, match=r'out 5\.0e-03'):
            assert not tb._agrees_on_first_use(q, k, v, scale, 3.0, 2, None)
        assert len(probes) == 4
        x, y = torch.randn(2, 3)
        matmul.fp32_precision = 'tf32'  # the conv's bound, under TF32 too
        with pytest.warns(RuntimeWarning, match=r'disagree.* out 5\.0e-03'):
            assert not tb.agrees_once(('conv', ), lambda a, b: a * b * (1 + 5e-3),
                                      lambda a, b: a * b, (x, y), ('out', 'x', 'y'),
                                      'conv kernels', '3x3')
    finally:
        matmul.fp32_precision = before


def test_one_head_keeps_two_query_passes_where_the_fused_one_spills(monkeypatch):
    """On GPUs with only the warp-level MMA (sm_80-89, sm_120) the one-head query
    side runs as with several heads (the fused pass spills there): the same
    values and gradients. sm_90 to sm_110 fuse it."""
    kernels = tb.kernels()
    launched = []
    real = kernels._query_state_grad_kernel

    class Counting:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]
    monkeypatch.setattr(kernels, 'capability', lambda device: (8, 0))
    monkeypatch.setattr(kernels, '_query_state_grad_kernel', Counting())
    check(torch.float32, 2, 37, 10, 32, 1, 3.0, True)
    assert len(launched) == 1
    for cap, passes in (((9, 0), 1), ((10, 0), 1), ((12, 0), 2)):
        monkeypatch.setattr(kernels, 'capability', lambda device: cap)
        check(torch.float32, 2, 37, 10, 32, 1, 3.0, True)
        assert len(launched) == passes, cap  # fused on sm_90 and sm_100, not sm_120
    assert [kernels.fuses_query_passes(cap) for cap in ((8, 6), (8, 9), (9, 0), (10, 0),
                                                         (10, 3), (11, 0), (12, 0), (12, 1))] \
        == [False, False, True, True, True, True, False, False]


def _auto_first_use(monkeypatch):
    """The backend as 'auto' runs it on a first call (the interpreter stands in
    for a GPU): a fresh first-use record, the process-wide state restored after."""
    monkeypatch.setattr(tb, 'get_backend', lambda: 'auto')
    monkeypatch.setattr(tb, '_AGREED', set())
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    probes = []
    real = tb._probe
    monkeypatch.setattr(tb, '_probe', lambda *a: probes.append(a[0]) or real(*a))
    return probes


def test_first_use_is_checked_against_the_torch_backend(monkeypatch):
    probes = _auto_first_use(monkeypatch)
    q, k, v, scale, mask, g = inputs(2, 37, 37, 64, torch.float32, masked=True)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # agreeing kernels warn nothing
        out = tb.triton_backend(q, k, v, scale, 3.0, 2, mask)
        again = tb.triton_backend(q, k, v, scale, 3.0, 2, mask)
    assert len(probes) == 2  # the kernels and the torch backend, once per configuration
    assert len(tb._AGREED) == 1 and torch.equal(out, again)
    tb.triton_backend(q[:, :, :32], k[:, :, :32], v[:, :, :32], scale[..., :32], 3.0, 1, None)
    assert len(probes) == 4 and len(tb._AGREED) == 2  # one head, no mask: checked too
    # a single key (a tiny image's reduced grid) is no test: left to a later call
    tb.triton_backend(q, k[:, :1], v[:, :1], scale, 3.0, 4, None)
    assert len(probes) == 4 and len(tb._AGREED) == 2
    # under inference_mode (no gradients) the output alone, once; the gradients
    # at the first call outside it
    with torch.inference_mode():
        tb.triton_backend(q, k, v, scale, 3.0, 4, None)
        tb.triton_backend(q, k, v, scale, 3.0, 4, None)
    assert len(probes) == 6 and ('attention', q.device, q.dtype, 16, False, False, True,
                                 torch.float32, 'forward') in tb._AGREED
    tb.triton_backend(q, k, v, scale, 3.0, 4, None)
    assert len(probes) == 8 and len(tb._AGREED) == 4
    with torch.inference_mode():
        tb.triton_backend(q, k, v, scale, 3.0, 4, None)
    assert len(probes) == 8
    # the kernels read the raw scale: a half one (a model cast to bf16) is checked apart
    tb.triton_backend(q, k, v, scale.bfloat16(), 3.0, 4, None)
    assert len(probes) == 10 and len(tb._AGREED) == 5


def test_disagreeing_kernels_warn_and_fall_back(monkeypatch):
    """A kernel that computes wrong on some GPU is never silent: the first call's
    check warns with the errors, returns the torch backend's output, and 'auto'
    keeps to the torch backend from then on."""
    _auto_first_use(monkeypatch)
    kernels = tb.kernels()
    real = kernels.forward

    def wrong(*args):
        out, *rest = real(*args)
        return (out * 1.5, *rest)
    monkeypatch.setattr(kernels, 'forward', wrong)
    q, k, v, scale, mask, g = inputs(1, 37, 37, 64, torch.float32, masked=True)
    with pytest.warns(RuntimeWarning, match=r'disagree with the .torch. backend .* out 5\.0e-01'):
        out = tb.triton_backend(q, k, v, scale, 3.0, 2, mask)
    expected = run('torch', q, k, v, scale, 3.0, 2, mask, g)[0]
    assert torch.allclose(out, expected, atol=1e-6) and not tb._KERNELS['importable']
    # also where only the output can be compared (inference_mode: no gradients)
    tb._KERNELS['importable'] = True
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match=r'out 5\.0e-01'):
        out = tb.triton_backend(q, k, v, scale, 3.0, 2, mask)
    assert torch.allclose(out, expected, atol=1e-6) and not tb._KERNELS['importable']


def test_tiling_override_for_timing_sweeps(monkeypatch):
    """FLATTEN_MM_TRITON_TILING changes the GPU's tiling for timing sweeps (the
    launches then carry it); bad values are refused with the value named, at the
    first plan rather than silently at import."""
    kernels = tb.kernels()
    monkeypatch.setattr(kernels, 'INTERPRETED', False)
    monkeypatch.setattr(kernels, '_TILING', {})
    monkeypatch.setenv('FLATTEN_MM_TRITON_TILING', 'block=64, bwd_block=16,warps=4,per_sm=8')
    fwd = kernels.plan(66_800, 48, 32, torch.bfloat16)
    bwd = kernels.plan(66_800, 48, 32, torch.bfloat16, backward=True)
    assert (fwd.block_n, bwd.block_n, fwd.warps) == (64, 16, 4)
    assert kernels._launch_opts(fwd)['num_warps'] == 4
    assert 48 * fwd.chunks >= 8 * 132  # eight programs per multiprocessor
    monkeypatch.setattr(kernels, '_TILING', {})
    monkeypatch.delenv('FLATTEN_MM_TRITON_TILING')
    default = kernels.plan(66_800, 48, 32, torch.bfloat16)
    assert (default.block_n, default.warps) == (128, 8) and 48 * default.chunks < 8 * 132
    for bad, named in (('block=48', 'block must be a power of two in \\[16, 512\\], got 48'),
                       ('warps=32', 'got 32'), ('per_sm=0', 'per_sm must be in'),
                       ('blocks=64', "got 'blocks=64'"), ('block=x', "got 'block=x'")):
        with pytest.raises(ValueError, match=named):
            kernels.parse_tiling(bad)


def test_every_launch_names_its_compile_options(monkeypatch):
    """Every kernel launch of the layer's forward and backward (attention with
    one head and with two, the fused DWC of V) asks for FMA contraction itself,
    as the kernels were built, checked and timed: triton 3.9 warns at the first
    build of a launch that leaves it to the default, and 3.10's default is off."""
    from flatten_mm.models import FocusedLinearAttention
    from flatten_mm.models.ops import triton_conv as tc
    launches = []

    class Recorded:  # kernel[grid](...) with the launch's keywords kept
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.name, kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch
    for module in (tb.kernels(), tc.kernels()):
        for name in [n for n in vars(module) if n.startswith('_') and n.endswith('_kernel')]:
            monkeypatch.setattr(module, name, Recorded(getattr(module, name), name))
    for heads in (1, 2):
        layer = FocusedLinearAttention(32, heads, sr_ratio=3 - heads).to(DEVICE)
        x = torch.randn(2, 30, 32, device=DEVICE)
        with use_backend('triton'):
            layer(x, (5, 6)).square().sum().backward()
    kernels = {name for module in (tb.kernels(), tc.kernels()) for name in vars(module)
               if name.startswith('_') and name.endswith('_kernel')}
    # every kernel: the inverse scale, row statistics, 6 token passes, the chunk sums, 3 conv
    assert {name for name, _ in launches} == kernels and len(kernels) == 12, sorted(kernels)
    bad = [name for name, kwargs in launches if kwargs.get('enable_fp_fusion') is not True]
    assert not bad, bad


def old_and_new_gpus(monkeypatch, caps: dict) -> None:
    """CUDA devices of these capabilities (index -> (major, minor)), for the
    checks that read them; nothing runs on them."""
    monkeypatch.setattr(tb, '_capability', lambda i: caps[0 if i is None else i])
    monkeypatch.setattr(tb, '_GPUS', {})


def test_auto_keeps_gpus_before_sm80_on_the_torch_backend(monkeypatch):
    """Kernels whose dots would all be emulated (V100, T4: no bf16 or tf32 tensor
    cores, and unsupported by triton) are not 'auto''s choice on such a GPU,
    for the attention and the fused DWC alike, while a newer GPU of the same
    process takes them (fake CUDA tensors here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flatten_mm.models.ops import triton_conv as tc
    caps = {0: (9, 0)}
    old_and_new_gpus(monkeypatch, caps)
    answers = []
    for older in ((7, 5), (7, 0), (8, 0), (8, 6), (12, 0)):
        caps[1] = older
        tb._GPUS.clear()
        for device in ('cuda:1', 'cuda:0'):
            with FakeTensorMode():
                q, k, v = (torch.empty(2, 49, 64).to(device) for _ in range(3))
                w, b = torch.empty(64, 1, 5, 5).to(device), torch.empty(64).to(device)
            answers.append((tb.supports(q, k, v, None, 2), tc.supports(q, v, w, b)))
    new = [(True, True)]
    assert answers == [(False, False)] + new + [(False, False)] + new + new * 6


def test_a_graph_traced_first_keeps_an_old_gpu_on_the_torch_backend(monkeypatch):
    """mmengine's compile=True traces before any eager call: the capability is
    asked while tracing, not taken as supported, and is a constant to the graph
    (no guard on the cache: another device asked later recompiles nothing)."""
    caps = {0: (7, 5), 1: (9, 0)}
    old_and_new_gpus(monkeypatch, caps)
    graphs, backend = recording_backend()
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda x: x + 1 if tb.gpu_supported(0) else x - 1, fullgraph=True,
                           backend=backend)
        assert torch.equal(fn(torch.zeros(2)), -torch.ones(2))
        assert tb.gpu_supported(1) and torch.equal(fn(torch.zeros(2)), -torch.ones(2))
        assert len(graphs) == 1
        # as supports() asks it: the index of a traced tensor's device (None: current)
        by_tensor = torch.compile(lambda x: x + 1 if tb.gpu_supported(x.device.index) else x - 1,
                                  fullgraph=True, backend=backend)
        assert torch.equal(by_tensor(torch.zeros(2)), -torch.ones(2)) and len(graphs) == 2
        caps[0] = (9, 0)
        tb._GPUS.clear()
        torch._dynamo.reset()
        assert torch.equal(fn(torch.zeros(2)), torch.ones(2))
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 3


def test_the_backward_makes_no_zero_gradients_for_the_states():
    """The op's states and row statistics are non-differentiable outputs:
    autograd hands its backward None for them, not four zero-filled tensors
    (``set_materialize_grads(False)``: four kernel launches fewer a layer on a
    GPU); the kernels take the raw scale, so no op outside the Triton ones makes
    1 / softplus(scale) or takes its gradient on (six ops a layer, two of them
    forward); the gradients stay the reference's."""
    q, k, v, scale, _, g = inputs(2, 24, 24, 16, torch.float32)
    ts = [t.detach().requires_grad_() for t in (q, k, v, scale)]
    with OpLog() as log, use_backend('triton'):
        out = focused_linear_attention(*ts, 3.0, 2, None)
    assert log.names == ['triton_focused_attention'], log.names
    with OpLog() as log:
        grads = torch.autograd.grad(out, ts, g)
    assert log.names == ['triton_focused_attention_backward'], log.names
    ref = run('reference', q, k, v, scale, 3.0, 2, None, g, torch.float64)
    for name, x, r in zip(NAMES[1:], grads, ref[1:]):
        assert rel_err(x, r) < TOL[torch.float32], name


def test_the_kernels_make_the_inverse_scale_and_its_gradient_as_torch():
    """The kernels take the layer's raw scale x: 1 / softplus(x) and its derivative,
    element by element, equal torch's in float64 to fp32's precision on both sides
    of softplus's threshold (20) and where exp(x) is below 1 + x's rounding (x < -16:
    a plain log(1 + exp(x)) is off by 1% at x = -12 and returns 0 below -17)."""
    x = torch.tensor([-40., -17., -12., -5., -1., 0., 0.5, 3., 19.9, 20., 20.1, 30., 80.],
                     device=DEVICE)
    s_inv, grad = torch.empty_like(x), torch.empty_like(x)
    with tb.on_device(x.device):
        _inverse_scale_probe[(1, )](x, s_inv, grad, x.numel(), BLOCK=16)
    x64 = x.double().requires_grad_()
    ref = 1 / F.softplus(x64)
    ref_grad, = torch.autograd.grad(ref.sum(), x64)
    assert torch.allclose(s_inv.double(), ref.detach(), rtol=2e-6, atol=0), (s_inv, ref)
    assert torch.allclose(grad.double(), ref_grad, rtol=2e-6, atol=0), (grad, ref_grad)


@pytest.mark.parametrize('value', [-18.0, 0.0, 21.0])
def test_scale_gradient_on_either_side_of_softplus_threshold(value):
    """The scale's gradient, taken on through softplus in the kernels, equals the
    reference's with the scale's channels around -18 (exp(x) below 1 + x's
    rounding: the log1p branch), around 0, and past softplus's threshold (20)."""
    q, k, v, scale, mask, g = inputs(2, 37, 29, 32, torch.float32, True)
    scale = scale + value
    got = run('triton', q, k, v, scale, 3.0, 2, mask, g)
    ref = run('reference', q, k, v, scale, 3.0, 2, mask, g, torch.float64)
    for name, x, r in zip(NAMES, got, ref):
        assert rel_err(x, r) < TOL[torch.float32], name
