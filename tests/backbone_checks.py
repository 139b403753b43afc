"""Checks every dense backbone must pass, shared by the backbone tests."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """The name of every op dispatched inside it (``triton_attention_local``,
    ``clone``, ...), in order, in ``names``."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def calls_of(op, step) -> list:
    """The positional arguments of every call of ATen ``op`` (an overload
    packet, e.g. ``torch.ops.aten.addcmul``) that ``step()`` dispatches."""
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is op:
                calls.append(args)
            return func(*args, **(kwargs or {}))
    with Record():
        step()
    return calls


def assert_cp_gives_same_gradients(make, x):
    """``make(**kw)`` builds a backbone; with_cp must not change gradients."""
    a = make(drop_path_rate=0.)
    b = make(drop_path_rate=0., with_cp=True)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        sum(o.square().sum() for o in m(x)).backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-6, msg=name)


def assert_autocast_finite(model, dtype, x):
    """Half-precision autocast, forward and backward (the backward called
    inside the autocast region, as some training loops do), stays finite and
    close to fp32 (relative in norm): every output within 2%; each
    parameter's gradient within 2% (fp16, with a dynamic loss scale) or 7%
    (bf16).

    The bounds leave at least twice the worst error seen on the small test
    backbones (docs/benchmarks.md, "Numerical margins of the tests"), and
    catch an attention core whose backward follows the ambient autocast
    instead of running in fp32, which is several times further off. The loss
    is a fixed random projection of the outputs (a sum of squares of
    LayerNorm outputs would be constant, its gradient rounding noise)."""
    model.train()
    for m in model.modules():  # no randomness: compare like for like
        if hasattr(m, 'drop_prob'):
            m.drop_prob = 0.0
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weights = [torch.randn(o.shape, generator=g) for o in model(x)]

    def run(loss_scale=1.0):
        model.zero_grad()
        outs = model(x)
        loss = sum((o.float() * w).mean() for o, w in zip(outs, weights))
        (loss * loss_scale).backward()
        return [o.detach().float() for o in outs], {
            n: p.grad / loss_scale for n, p in model.named_parameters() if p.grad is not None}
    ref_outs, ref_grads = run()
    # fp16 trains with a dynamic loss scale (AmpOptimWrapper's): the largest
    # of these without inf; unscaled, small gradients fall into subnormals
    for scale in ((2.0 ** 12, 2.0 ** 8, 2.0 ** 4, 1.0) if dtype == torch.float16 else (1.0,)):
        with torch.autocast('cpu', dtype=dtype):
            outs, grads = run(scale)
        if all(torch.isfinite(g).all() for g in grads.values()):
            break
    for o, r in zip(outs, ref_outs):
        assert torch.isfinite(o).all()
        assert ((o - r).norm() / r.norm()).item() < 0.02
    assert grads.keys() == ref_grads.keys()
    grad_tol = 0.02 if dtype == torch.float16 else 0.07
    for name, grad in grads.items():
        r = ref_grads[name]
        assert torch.isfinite(grad).all(), name
        err = ((grad.float() - r).norm() / r.norm()).item()
        assert err < grad_tol, f'{name}: gradient off by {err:.3f} relative'


# odd and tiny inputs, down to stages that hold a single token
TRAIN_SIZES = [(1, 1), (2, 3), (5, 7), (8, 8), (17, 9), (32, 32), (33, 65)]


def assert_trains_at_every_size(model, sizes=TRAIN_SIZES, batch_sizes=(1, 2),
                                strides=(4, 8, 16, 32)):
    """Training mode with gradients: for every input size the stage maps are
    ceil(H / s) x ceil(W / s) and finite, and every parameter gets a finite
    gradient (drop path off, so every branch runs)."""
    model.train()
    for m in model.modules():
        if hasattr(m, 'drop_prob'):
            m.drop_prob = 0.0
    for (h, w) in sizes:
        for b in batch_sizes:
            model.zero_grad()
            x = torch.randn(b, 3, h, w, requires_grad=True)
            outs = model(x)
            for o, s in zip(outs, strides):
                assert tuple(o.shape) == (b, o.shape[1], -(-h // s), -(-w // s)), (h, w, b)
                assert torch.isfinite(o).all(), (h, w, b)
            sum((o * torch.randn_like(o)).sum() for o in outs).backward()
            assert torch.isfinite(x.grad).all(), (h, w, b)
            for name, p in model.named_parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all(), (name, h, w, b)


def cache_state(model):
    """Every module's tensor cache: its keys and the identity of each value."""
    return {name: {key: id(value) for key, value in m.__dict__.get('_tensor_cache', {}).items()}
            for name, m in model.named_modules()}


def projection_loss(outs, seed=0):
    """A fixed random projection of the outputs (sums of squares of
    LayerNorm-ed maps are constant, their gradients rounding noise)."""
    g = torch.Generator().manual_seed(seed)
    return sum((o * torch.randn(o.shape, generator=g).to(o.device)).mean() for o in outs)


def loss_and_grads(model, x):
    """The outputs (a backbone's maps, a dict's values, or one tensor) and every
    parameter's gradient of :func:`projection_loss`; the global seed is set
    first, so drop paths fall alike in every call."""
    model.zero_grad()
    torch.manual_seed(2)
    out = model(x)
    outs = list(out.values()) if isinstance(out, dict) else out
    outs = [outs] if isinstance(outs, torch.Tensor) else outs
    loss = projection_loss(outs)
    loss.backward()
    params = getattr(model, '_orig_mod', model).named_parameters()  # compiled: the original's
    return [o.detach() for o in outs], {n: p.grad.clone() for n, p in params}


def assert_caches_reused(model, hw=(45, 67)):
    """In eval mode without gradients, what depends only on the input size is
    made once per size: a second forward at that size adds and rebuilds no
    cache entry, and gives the outputs of the uncached (grad-mode) forward.
    New weights are never served stale encodings. Training steps serve the
    size entries too (no new entry) and equal the step that made them: no
    consumer changed a cached tensor in place."""
    model.eval()
    x = torch.randn(1, 3, *hw)
    with torch.no_grad():
        first = model(x)
    state = cache_state(model)
    assert sum(len(v) for v in state.values()) > 0
    with torch.no_grad():
        second = model(x)
    assert cache_state(model) == state
    uncached = model(x)
    for a, b, c in zip(first, second, uncached):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c.detach(), rtol=1e-5, atol=1e-5)
    torch.manual_seed(1)
    model.load_state_dict({k: v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v
                           for k, v in model.state_dict().items()})
    with torch.no_grad():
        cached = model(x)
    for a, c in zip(cached, model(x)):
        torch.testing.assert_close(a, c.detach(), rtol=1e-5, atol=1e-5)
    model.train()
    x = torch.randn(2, 3, *hw[::-1])  # a new size: the first step makes its entries
    made = loss_and_grads(model, x)
    state = cache_state(model)
    served = loss_and_grads(model, x)
    assert cache_state(model) == state
    assert all(torch.equal(a, b) for a, b in zip(made[0], served[0], strict=True))
    for name, grad in made[1].items():
        assert torch.equal(grad, served[1][name]), name


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| in norm, got taken to want's dtype (a want of zeros:
    the norm of got over 1e-30)."""
    return ((got.to(want.dtype) - want).norm() / want.norm().clamp(min=1e-30)).item()


def assert_grads_close(got: dict, want: dict, rtol: float):
    """Same parameter names, each gradient within ``rtol`` of ``want``'s in
    norm (exact zeros: the last DeiT block's DWC reaches no class-token logit)."""
    assert got.keys() == want.keys()
    for name, g in got.items():
        err = relative_error(g, want[name])
        assert err < rtol, f'{name}: {err:.2e}'


FAMILIES = ('pvt', 'pvtv2', 'swin', 'cswin')


def small_backbone(family: str, **kw):
    """A small initialised backbone of ``family`` (one of FAMILIES), with
    linear and softmax stages unless ``attn_type`` says otherwise."""
    from flatten_mm import FLattenCSwin, FLattenDeiT, FLattenPVT, FLattenPVTv2, FLattenSwin
    if family == 'deit':  # not in FAMILIES: one grid, a stage per block
        m = FLattenDeiT(**dict(dict(embed_dims=32, num_heads=2, depth=4, attn_type='LSLL',
                                    final_norm=True, out_indices=(1, 3)), **kw))
        m.init_weights()
        return m
    if family in ('pvt', 'pvtv2'):
        kw = dict(dict(embed_dims=[16, 32, 48, 64], num_heads=[1, 2, 3, 4], depths=[1, 1, 1, 1],
                       arch='tiny' if family == 'pvt' else 'b0', attn_type='LLSS'), **kw)
        cls = FLattenPVT if family == 'pvt' else FLattenPVTv2
    else:
        kw = dict(dict(embed_dims=16, num_heads=[2, 2, 4, 4], depths=[1, 2, 2, 1]), **kw)
        cls = FLattenSwin if family == 'swin' else FLattenCSwin
    m = cls(**kw)
    m.init_weights()
    return m
