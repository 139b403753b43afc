"""PyTorch's tooling on our models: torch.fx through timm's feature
extractor, torch.compile (full graph, training), torch.export and ONNX."""
import copy
import io

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import create_feature_extractor, get_notrace_functions, get_notrace_modules

import flatten_mm  # noqa: F401  (registers the models and their fx leaves in timm)
from flatten_mm import FLattenCSwin, FLattenDeiT, FLattenPVT, FLattenPVTv2, FLattenSwin
from flatten_mm.models import utils

from backbone_checks import assert_grads_close, cache_state, loss_and_grads, relative_error

# small classifiers of each family: one or two blocks per stage
SMALL = {
    'flatten_pvt_tiny': dict(depths=[1, 1, 1, 1]),
    'flatten_pvt_v2_b0': dict(depths=[1, 1, 1, 1]),
    'flatten_swin_tiny': dict(embed_dims=32, depths=[2, 2, 2, 2], num_heads=[1, 2, 4, 8]),
    'flatten_cswin_tiny': dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[2, 2, 4, 4]),
    'flatten_deit_tiny': dict(embed_dims=32, num_heads=2, depth=3, attn_type='LSL'),
}
BACKBONES = {
    'pvt': (FLattenPVT, dict(embed_dims=[16, 32, 48, 64], num_heads=[1, 2, 3, 4],
                             depths=[1, 1, 1, 1], attn_type='LLSS')),
    'pvtv2': (FLattenPVTv2, dict(arch='b0', depths=[1, 1, 1, 1])),
    'swin': (FLattenSwin, dict(embed_dims=16, num_heads=[1, 2, 2, 4], depths=[2, 2, 2, 2])),
    'cswin': (FLattenCSwin, dict(embed_dims=16, num_heads=[2, 2, 4, 4], depths=[1, 1, 1, 1])),
    'deit': (FLattenDeiT, dict(embed_dims=32, num_heads=2, depth=3, attn_type='LSL',
                               final_norm=True, out_indices=(0, 2))),
}


# PVT with linear attention on reduced keys (q is the q projection's output)
REDUCED_KEYS = dict(embed_dims=[16, 32, 48, 64], num_heads=[1, 2, 3, 4], depths=[1, 1, 1, 1],
                    attn_type='LLLL', sr_ratios=[4, 2, 1, 1])


def backbone(kind, **overrides):
    if kind == 'pvt-reduced-keys':
        return FLattenPVT(**REDUCED_KEYS, drop_path_rate=0.)
    cls, kw = BACKBONES[kind]
    return cls(**dict(kw, **overrides), drop_path_rate=0.)


@pytest.mark.parametrize('name', sorted(SMALL))
def test_fx_feature_extractor_equals_eager_forward_and_backward(name):
    """Traced as timm traces (its leaf modules and functions): the graph's
    logits and every parameter's gradient equal eager mode."""
    model = timm.create_model(name, **SMALL[name], num_classes=10, drop_path_rate=0.).train()
    x = torch.randn(2, 3, 70, 90)
    fx_model = create_feature_extractor(model, ['head'])
    assert isinstance(fx_model, torch.fx.GraphModule)
    want, want_grads = loss_and_grads(model, x)
    got, got_grads = loss_and_grads(fx_model, x)
    assert got[0].shape == (2, 10)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert_grads_close(got_grads, want_grads, 1e-5)


@pytest.mark.parametrize('name', sorted(SMALL))
def test_fx_feature_extractor_traces_stochastic_depth(name):
    """With drop path and gradient checkpointing (as models are trained),
    timm's extractor traces a training graph too; drawn from the same seed,
    its logits and gradients equal eager training's (PVT's, PVTv2's and
    DeiT's blocks could not be traced: drop path's residual add branches on
    dtypes; no family traced with checkpointing: it asked whether the tokens
    require gradients). The graph holds no checkpoint, as timm's own."""
    model = timm.create_model(name, **SMALL[name], num_classes=10, drop_path_rate=0.5).train()
    model.set_grad_checkpointing()
    fx_model = create_feature_extractor(model, ['head'])
    assert not any('checkpoint' in str(node.target) for node in fx_model.graph.nodes)
    x = torch.randn(2, 3, 40, 56)
    want, want_grads = loss_and_grads(model, x)
    got, got_grads = loss_and_grads(fx_model, x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert_grads_close(got_grads, want_grads, 1e-5)
    with torch.no_grad():  # (the inference graph: other logits, so drop path was at work)
        assert not torch.allclose(fx_model.eval()(x)['head'], got[0], rtol=1e-3, atol=1e-4)


def test_fx_graph_widens_narrow_half_maps_when_it_runs():
    """CSwin's merges widen a map that their strided conv turns into one
    column in CPU bf16 (PyTorch's kernel gets such weight gradients wrong).
    A traced graph decides that when it runs, for each input: under bf16
    autocast its merge convs' weight gradients are fp32's within 5 % at every
    width that makes some merge's output one pixel wide (a graph of the plain
    conv gave NaN or inf at each of them)."""
    model = timm.create_model('flatten_cswin_tiny', **SMALL['flatten_cswin_tiny'],
                              num_classes=10, drop_path_rate=0.).train()
    fx_model = create_feature_extractor(model, ['head'])
    assert any(node.target is utils.widen_narrow_half_map for node in fx_model.graph.nodes)

    def merge_grads(run, x, half):
        model.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=half):
            out = run(x)
        out = out['head'] if isinstance(out, dict) else out
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [model.get_submodule(f'merge{i}').conv.weight.grad.clone() for i in (1, 2, 3)]
    for width in (4, 8, 16):  # (a stride-4 stem: merge1, merge2 and merge3 get one column)
        x = torch.randn(2, 3, 64, width)
        want = merge_grads(model, x, False)
        for i, (got, ref) in enumerate(zip(merge_grads(fx_model, x, True), want)):
            assert relative_error(got, ref) < 0.05, (width, i + 1, relative_error(got, ref))


def trace_as_timm(model):
    """torch.fx with timm's leaf modules and functions (what its
    create_feature_extractor uses), for models that return a tuple."""
    leaves = tuple(get_notrace_modules())

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, leaves) or super().is_leaf_module(m, qualname)
    tracer = Tracer(autowrap_functions=tuple(get_notrace_functions()))
    return torch.fx.GraphModule(model, tracer.trace(model))


@pytest.mark.parametrize('kind', sorted(BACKBONES))
def test_fx_traces_dense_backbones(kind):
    model = backbone(kind).train()
    x = torch.randn(2, 3, 45, 77)
    want, want_grads = loss_and_grads(model, x)
    got, got_grads = loss_and_grads(trace_as_timm(model), x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_grads_close(got_grads, want_grads, 1e-5)


# inductor (what users run) on the backbone with both attention kinds; the graph
# capture of the others through AOTAutograd alone, to keep the suite short
@pytest.mark.parametrize('kind,backend,with_cp', [
    ('pvt', 'inductor', False), ('swin', 'aot_eager', False), ('pvtv2', 'aot_eager', False),
    ('cswin', 'aot_eager', False), ('deit', 'aot_eager', False), ('pvt', 'aot_eager', True)])
def test_compiled_training_step_equals_eager(kind, backend, with_cp):
    """torch.compile(fullgraph=True) captures forward and backward without a
    graph break, with gradient checkpointing too (whose recomputation keeps
    the forward's attention backend in eager only: dynamo takes no other
    context than its own); losses and gradients equal eager to 1e-4 relative."""
    # inductor's C++ builds take 10 s a stage: an L and an S stage only
    model = backbone(kind, with_cp=with_cp,
                     **({'attn_type': 'LSLL'} if backend == 'inductor' else {})).train()
    if backend == 'inductor':
        model.prune_stages(2)
    x = torch.randn(2, 3, 64, 96)
    want, want_grads = loss_and_grads(model, x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got, got_grads = loss_and_grads(compiled, x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert_grads_close(got_grads, want_grads, 1e-4)


def test_make_fx_traces_a_checkpointed_backbone():
    """make_fx (AOTAutograd's tracer) of a backbone in training with
    ``with_cp``: under a proxy mode checkpoint takes dispatch modes as its
    contexts and raised ``AssertionError`` for the context that keeps a
    block's backend in eager mode; the graph computes eager's outputs."""
    from torch.fx.experimental.proxy_tensor import make_fx
    model = backbone('pvt', with_cp=True).train()
    model.prune_stages(1)
    x = torch.randn(1, 3, 29, 37, requires_grad=True)
    graph = make_fx(lambda images: model(images))(x)
    for got, want in zip(graph(x), model(x), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize('kind', sorted(BACKBONES) + ['pvt-reduced-keys'])
def test_compiled_inference_is_one_graph_equal_to_eager(kind):
    """Inference as a test loop runs it (eval, no gradient, where the layers may
    overwrite q and k): torch.compile(fullgraph=True) captures the forward
    without a graph break (it broke on the core's out= into q's strided view
    in every layer) and equals eager."""
    model = backbone(kind).eval()
    x = torch.randn(2, 3, 45, 77)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend='eager')
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            for a, b in zip(compiled(x), model(x)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def outputs_changed_after_return(model, x, grad: bool) -> list:
    """Modules whose output tensor, as a forward hook holds it, differs after
    the model's forward (and backward) from what the module returned."""
    held, names = [], {m: n for n, m in model.named_modules()}

    def hold(module, args, out):
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                held.append((names[module], t, t.detach().clone()))
    hooks = [m.register_forward_hook(hold) for m in model.modules()]
    with torch.set_grad_enabled(grad):
        outs = model(x)
        if grad:
            sum(o.sum() for o in outs).backward()
    for h in hooks:
        h.remove()
    assert len(held) > 20
    return sorted({n for n, t, was in held if not torch.equal(t.detach(), was)})


@pytest.mark.parametrize('kind', sorted(BACKBONES) + ['pvt-reduced-keys'])
def test_forward_hooks_hold_what_modules_returned(kind):
    """A hook that keeps a module's output (feature extraction, visualisation)
    keeps what the module returned: in inference the blocks summed the
    residual into the attention's and MLP's outputs in place, and layers with
    reduced keys overwrote the q projection's output with the focused map."""
    model, x = backbone(kind), torch.randn(2, 3, 45, 77)
    assert outputs_changed_after_return(model.eval(), x, grad=False) == []
    assert outputs_changed_after_return(model.train(), x, grad=True) == []


@pytest.mark.parametrize('kind', sorted(BACKBONES) + ['pvt-reduced-keys'])
def test_hooks_run_on_every_submodule_and_change_nothing(kind):
    """A forward hook on any submodule runs, where the layers apply some
    submodules' parameters themselves when none is hooked (q and kv as one
    product, the DWC and LePE in the fused conv, the MLP in chunks on CPU):
    hooked, they are called. Outputs and gradients equal the unhooked model's
    (other roundings: 1e-5). Left out: the placeholder Identity of CSwin's stem
    (the release's rearrangement, done on the tensor's layout)."""
    model, x = backbone(kind).train(), torch.randn(2, 3, 45, 77)
    want, want_grads = loss_and_grads(model, x)
    leaves = {n: m for n, m in model.named_modules()
              if not list(m.children()) and not isinstance(m, torch.nn.Identity)}
    ran = set()
    for name, m in leaves.items():
        m.register_forward_hook(lambda m, args, out, name=name: ran.add(name))
    got, got_grads = loss_and_grads(model, x)
    assert set(leaves) - ran == set()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert_grads_close(got_grads, want_grads, 1e-5)
    ran.clear()
    with torch.no_grad():
        model.eval()(x)
    assert set(leaves) - ran == set()


def test_hooks_run_in_compiled_graphs():
    """Compiled, as in eager mode, a hooked submodule is called (dynamo traces
    its hook into the graph): one graph, hooks on every leaf of FLatten-CSwin
    (DWC, LePE, q, kv, the MLP's layers) run, the output equals eager's."""
    model, x = backbone('cswin').eval(), torch.randn(2, 3, 45, 77)
    leaves = {n: m for n, m in model.named_modules()
              if not list(m.children()) and not isinstance(m, torch.nn.Identity)}
    ran = set()
    for name, m in leaves.items():
        m.register_forward_hook(lambda m, args, out, name=name: ran.add(name))
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(x)
        ran.clear()
        got = torch.compile(model, fullgraph=True, backend='eager')(x)
    assert set(leaves) - ran == set()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class LoraLinear(torch.nn.Linear):
    """A LoRA layer as adapter libraries write one: an ``nn.Linear`` subclass
    that keeps the weight and bias and adds a low-rank product."""

    def forward(self, x):
        return super().forward(x) + F.linear(F.linear(x, self.down), self.up)


class ShiftedConv(torch.nn.Conv2d):
    """A conv subclass whose output takes an extra per-channel shift."""

    def forward(self, x):
        return super().forward(x) + self.shift


def adapt_every_linear_and_conv(model):
    """Every nn.Linear a :class:`LoraLinear` with a random low-rank product,
    every nn.Conv2d a :class:`ShiftedConv` with a random shift."""
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = LoraLinear
            m.down = torch.nn.Parameter(0.3 * torch.randn(2, m.in_features))
            m.up = torch.nn.Parameter(0.3 * torch.randn(m.out_features, 2))
        elif type(m) is torch.nn.Conv2d and m.bias is not None:
            m.__class__ = ShiftedConv
            m.shift = torch.nn.Parameter(0.3 * torch.randn(m.out_channels, 1, 1))
    return model


def merged(model):
    """A copy of an adapted model with the adapters folded into plain modules."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for m in model.modules():
            if type(m) is LoraLinear:
                m.weight += m.up @ m.down
                del m.up, m.down
                m.__class__ = torch.nn.Linear
            elif type(m) is ShiftedConv:
                m.bias += m.shift.flatten()
                del m.shift
                m.__class__ = torch.nn.Conv2d
    return model


@pytest.mark.parametrize('kind', sorted(BACKBONES) + ['pvt-reduced-keys'])
def test_adapted_submodules_compute_what_they_return(kind):
    """Adapters (LoRA layers, quantised or otherwise derived classes) replace
    the q, kv, MLP and DWC/LePE modules, whose parameters the layers otherwise
    apply themselves (one q, kv product, the fused DWC and LePE, the chunked
    MLP): a subclass's forward was skipped (its weight and bias applied as if
    plain, the low-rank term lost), a wrapper without ``weight`` raised. Every
    Linear and Conv2d adapted, the model equals one with the adapters folded
    into its weights: outputs in inference, outputs and the shared
    parameters' gradients in training (1e-4: other roundings)."""
    torch.manual_seed(0)
    model = adapt_every_linear_and_conv(backbone(kind)).eval()
    plain, x = merged(model), torch.randn(2, 3, 45, 77)
    with torch.no_grad():
        for a, b in zip(model(x), plain(x)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    got, got_grads = loss_and_grads(model.train(), x)
    want, want_grads = loss_and_grads(plain.train(), x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert_grads_close({n: got_grads[n] for n in want_grads}, want_grads, 1e-4)
    # the adapters' own parameters, by the chain rule through the folded weights
    adapter_grads = {}
    for name, m in model.named_modules():
        if type(m) is LoraLinear:
            g = want_grads[f'{name}.weight']
            adapter_grads[f'{name}.up'], adapter_grads[f'{name}.down'] = g @ m.down.T, m.up.T @ g
        elif type(m) is ShiftedConv:
            adapter_grads[f'{name}.shift'] = want_grads[f'{name}.bias'].view_as(m.shift)
    assert len(adapter_grads) == len(got_grads) - len(want_grads)
    assert_grads_close({n: got_grads[n] for n in adapter_grads}, adapter_grads, 1e-4)


@pytest.mark.filterwarnings('ignore:torch.quantize_per_tensor')  # deprecated in torch 2.14
@pytest.mark.parametrize('kind', ['pvt', 'swin'])
def test_quantised_and_parametrised_linears_run(kind):
    """torch.ao's dynamic int8 quantisation of every nn.Linear (whose weight is
    a method: the stacked q, kv product raised a TypeError on it) stays within
    its rounding of the float model (1-4 % measured; 10 % allowed), and
    weight-normalised linears (a parametrised subclass) equal the plain ones."""
    model, x = backbone(kind).eval(), torch.randn(2, 3, 45, 77)
    with torch.no_grad():
        want = model(x)
        quantised = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
        for a, b in zip(quantised(x), want):
            assert 0 < ((a - b).norm() / b.norm()).item() < 0.1
        normed = copy.deepcopy(model)
        for m in list(normed.modules()):
            if type(m) is torch.nn.Linear:
                torch.nn.utils.parametrizations.weight_norm(m)
        for a, b in zip(normed(x), want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mmpretrain_lora_model_adapts_a_backbone():
    """mmpretrain's LoRAModel on FLatten-PVT's q, kv and MLP layers (its
    LoRALinear wraps the layer: no ``weight`` of its own) equals the backbone
    with the low-rank products folded into those weights."""
    from mmpretrain.models.peft import LoRAModel
    kw = dict(BACKBONES['pvt'][1], drop_path_rate=0.)
    torch.manual_seed(0)
    lora = LoRAModel(module=dict(type='FLattenPVT', **kw), alpha=4, rank=2, targets=[
        dict(type=name) for name in ('.q', '.kv', 'fc1', 'fc2')])
    plain = copy.deepcopy(lora.module)
    wrapped = [(n, m) for n, m in lora.module.named_modules() if type(m).__name__ == 'LoRALinear']
    assert len(wrapped) == 16  # four layers in each of four blocks
    with torch.no_grad():
        for name, m in wrapped:
            torch.nn.init.normal_(m.lora_up.weight, std=0.3)
            base = m.original_layer
            folded = torch.nn.Linear(base.in_features, base.out_features)
            folded.weight.copy_(base.weight + m.scaling * m.lora_up.weight @ m.lora_down.weight)
            folded.bias.copy_(base.bias)
            plain.set_submodule(name, folded)
        x = torch.randn(2, 3, 45, 77)
        for a, b in zip(lora.eval()(x), plain.eval()(x)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def tensor_caches(model):
    """Each module's tensor cache, by module name (modules without one left out)."""
    return {n: m.__dict__['_tensor_cache'] for n, m in model.named_modules()
            if '_tensor_cache' in m.__dict__}


def test_compiled_training_leaves_the_caches_alone():
    """A trace neither drops nor fills nor reads a layer's tensor cache: the
    dynamo of torch 2.11 (the torch of the H200 figures) cannot trace the
    module-dict operations behind it (a graph break in every attention layer).
    The eager cache, filled in eval and in eager training, is the same dict
    with the same entries after compiled training, and the compiled step
    equals eager."""
    model = backbone('pvt').eval()
    x = torch.randn(1, 3, 45, 77)
    with torch.no_grad():
        model(x)
    model.train()
    want, want_grads = loss_and_grads(model, x)
    caches, entries = tensor_caches(model), cache_state(model)
    assert caches
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend='eager')
    got, got_grads = loss_and_grads(compiled, x)
    assert tensor_caches(model).keys() == caches.keys()
    assert all(model.get_submodule(n).__dict__['_tensor_cache'] is cache
               for n, cache in caches.items())
    assert cache_state(model) == entries
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert_grads_close(got_grads, want_grads, 1e-4)


def recording_backend(graphs, aot=True):
    """aot_eager (or dynamo alone: 'eager') that records the example inputs
    of each graph it compiles."""
    from torch._dynamo.backends.registry import lookup_backend
    compile_graph = lookup_backend('aot_eager' if aot else 'eager')

    def backend(gm, example_inputs):
        graphs.append(example_inputs)
        return compile_graph(gm, example_inputs)
    return backend


@pytest.mark.heavy(20)
def test_compiled_second_size_is_one_static_recompile():
    """Default settings (dynamic=None): a second input size recompiles once,
    specialised to its size (no symbolic shapes: tracing them took minutes and
    crashed Inductor on CUDA), and trains as eager does."""
    model = backbone('swin').train()
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording_backend(graphs))
    for size in ((64, 96), (72, 80), (64, 96)):
        x = torch.randn(2, 3, *size)
        want, want_grads = loss_and_grads(model, x)
        got, got_grads = loss_and_grads(compiled, x)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert_grads_close(got_grads, want_grads, 1e-4)
    assert len(graphs) == 2  # one per size, the first size's reused
    for inputs in graphs:
        assert not any(isinstance(i, torch.SymInt) or isinstance(i, torch.Tensor) and any(
            isinstance(d, torch.SymInt) for d in i.shape) for i in inputs)


def test_image_sizes_specialised_under_compile_not_export():
    """check_images makes H and W constants of each compiled graph (a second size
    is one static recompile) but leaves them symbolic in torch.export; the
    export test reads torch's flag (the dynamo of torch 2.11, the torch of the H200 figures,
    folds ``torch.compiler.is_exporting()`` to True under torch.compile too:
    sizes went symbolic there, checked with that torch)."""
    graphs = []
    torch._dynamo.reset()
    model = _Images()
    compiled = torch.compile(model, backend=recording_backend(graphs, aot=False))
    for size in (5, 6, 7):
        x = torch.randn(1, 2, size, size + 1)
        torch.testing.assert_close(compiled(x), model(x))  # + 0: not exporting
    assert len(graphs) == 3 and all(len(g) == 1 and isinstance(g[0], torch.Tensor) and all(
        isinstance(d, int) for d in g[0].shape) for g in graphs)
    dims = {'h': torch.export.Dim('h', min=2), 'w': torch.export.Dim('w', min=2)}
    program = torch.export.export(model, (torch.randn(1, 2, 5, 6), ),
                                  dynamic_shapes={'x': {2: dims['h'], 3: dims['w']}})
    x = torch.randn(1, 2, 9, 4)
    torch.testing.assert_close(program.module()(x), model(x) + 1)  # + 1: exporting


class _Images(torch.nn.Module):
    def forward(self, x):
        from flatten_mm.models.layers import check_images
        from flatten_mm.models.utils import is_exporting
        return check_images(x).sum(-1) * x.shape[-2] + float(is_exporting())


def test_drop_path_rates_do_not_recompile_blocks(monkeypatch):
    """With a graph break inside every attention layer (as once on CUDA), each
    block's remainder is compiled on its own: blocks with different drop-path
    rates must share that code (no guard on the rate), i.e. compile as many
    graphs as blocks that all have the same rate, and Swin's shift adds at
    most one variant."""
    from flatten_mm.models import attention
    from flatten_mm.models.backbones.flatten_swin import SwinBlock
    project = attention.stacked_qkv  # the projection of every layer here, masked or not

    def project_with_break(*args):
        torch._dynamo.graph_break()
        return project(*args)
    monkeypatch.setattr(attention, 'stacked_qkv', project_with_break)

    class Blocks(torch.nn.Sequential):
        def forward(self, x):
            for block in self:
                x = block(x, (8, 8))
            return x
    counts = []
    for rates in ([0.05 * i for i in range(8)], [0.2] * 8):
        blocks = Blocks(*[SwinBlock(16, 2, 'L', (4, 4), i % 2 == 1, (4, 4), 3, 5, drop_path=r)
                          for i, r in enumerate(rates)]).train()
        torch._dynamo.reset()
        graphs = []
        compiled = torch.compile(blocks, backend=recording_backend(graphs, aot=False))
        compiled(torch.randn(2, 64, 16, requires_grad=True)).sum().backward()
        counts.append(len(graphs))
    # a few parts per block (split at the breaks), each shifted or not (the shifted
    # blocks' masked layers take two ops, the others one call): not 8 x parts
    assert counts[0] == counts[1] <= 14, counts


@pytest.mark.parametrize('kind', sorted(BACKBONES))
def test_torch_export_equals_eager(kind):
    """The exported program gives eager's outputs up to float rounding (its
    decomposed ops may sum in another order: 1e-6 absolute was seen on
    CSwin's 1e-2-sized features)."""
    model = backbone(kind).eval()
    x = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(0))
    program = torch.export.export(model, (x,))
    with torch.no_grad():
        for a, b in zip(program.module()(x), model(x)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('kind, example, sizes', [
    ('pvtv2', (224, 224), ((64, 96), (256, 320))),
    ('deit', (224, 224), ((64, 96), (256, 320))),
    pytest.param('cswin', (160, 192), ((224, 224),), marks=pytest.mark.heavy(40))])
def test_torch_export_with_dynamic_image_sizes(kind, example, sizes):
    """Exported with image sides as symbolic multiples of 32 (``32 * Dim``),
    the program equals eager at other sizes. It stopped (``Guard failed``)
    where a size took another shortcut than the example's
    (``utils.sizes_symbolic``: the general forms where sizes are symbolic):
    PVTv2 and DeiT exported at the pretraining size at every other size (the
    example's grid was the positional encoding's, the resize's shortcut for
    equal sizes a guard); CSwin where a stage's stripes needed no padding and
    the example's did (the crop after its stripes, a view whose strides torch
    guarded on)."""
    model = BACKBONES[kind][0](**BACKBONES[kind][1]).eval()
    h, w = torch.export.Dim('h', min=2, max=64), torch.export.Dim('w', min=2, max=64)
    program = torch.export.export(model, (torch.randn(2, 3, *example),),
                                  dynamic_shapes=({2: 32 * h, 3: 32 * w},))
    for size in sizes:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            for a, b in zip(program.module()(x), model(x), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class Bf16Autocast(torch.nn.Module):
    """A model run under bf16 autocast from inside its forward: how a
    mixed-precision program is exported (torch.export does not record an
    autocast entered around the export call, only one inside forward)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.model(x)


@pytest.mark.parametrize('kind', ['pvt', 'swin'])  # an fp32 and a bf16 residual stream
def test_torch_export_keeps_autocast_inside_forward(kind):
    """Exported with autocast in its forward, the program runs without one
    and gives the eager autocast outputs, in their dtypes (bf16, or fp32 where
    the residual stream is fp32: PVT and DeiT add an fp32 position
    embedding), so the casts were recorded, the attention's fp32 region too.
    Measured: equal, every family (PVTv2, CSwin, DeiT too), where autocast's
    outputs differ from fp32's by 9e-3 to 4e-2; bound 1e-3."""
    model = Bf16Autocast(backbone(kind).eval())
    x = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(0))
    program = torch.export.export(model, (x,))
    x = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for a, b in zip(program.module()(x), model(x)):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=1e-3)


@pytest.mark.heavy(25)
def test_onnx_export_runs_in_onnxruntime(tmp_path):
    """FLatten-PVT-T's backbone through torch.onnx (dynamo exporter) and
    onnxruntime's CPU provider, against eager."""
    model = FLattenPVT(arch='tiny', drop_path_rate=0.).eval()
    exported_equals_eager(model, torch.randn(1, 3, 96, 128), tmp_path / 'pvt.onnx', True)


def no_zero_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its all-zero parameters (positional encodings, bias
    tables, as initialised) drawn at random: torch.onnx dropped the positional
    encodings' add (into a view), which zeros hid."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.5)
    return model


def exported_equals_eager(model, x, path, dynamo: bool) -> None:
    """``model`` exported by torch.onnx at x's size: onnxruntime's CPU
    provider gives its four stage outputs, as eager."""
    ort = pytest.importorskip('onnxruntime')
    no_zero_parameters(model)
    torch.onnx.export(model, (x,), str(path), dynamo=dynamo)
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = model(x)
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings('ignore::torch.jit.TracerWarning')  # sizes become constants
@pytest.mark.parametrize('kind', ['pvt', 'swin', 'cswin'])
def test_torchscript_onnx_exporter_runs_in_onnxruntime(kind, tmp_path):
    """torch.onnx.export's TorchScript exporter (``dynamo=False``, as
    mmdeploy exports) at a fixed size that stages pad: onnxruntime's outputs
    equal eager. It failed in its peephole pass on the attention's and the
    conv's Python autograd functions (``IndexError: Argument passed to at()
    was not in the map``; its trace now records their plain ops), then at
    sizes that pad on the shared DWC kernel's traced repeat count (now ints),
    and for CSwin on the unknown shape of LePE's padded kernel (now zeros
    concatenated)."""
    model = dict(pvt=lambda: FLattenPVT(arch='tiny', depths=[1, 1, 1, 1]),
                 swin=lambda: FLattenSwin(embed_dims=32, depths=[2, 2, 2, 2],
                                          num_heads=[1, 2, 4, 8]),
                 cswin=lambda: FLattenCSwin(**BACKBONES['cswin'][1]))[kind]().eval()
    exported_equals_eager(model, torch.randn(1, 3, 64, 72), tmp_path / f'{kind}.onnx', False)


@pytest.mark.filterwarnings('ignore::torch.jit.TracerWarning')  # the input checks' bools
@pytest.mark.parametrize('kind', sorted(BACKBONES))
def test_torchscript_onnx_export_with_dynamic_axes(kind, tmp_path):
    """The TorchScript exporter with mmdeploy's dynamic axes (batch, height,
    width): the graph equals eager at any batch and image size, 1x1 and odd
    sizes too. Its trace records the sizes and the arithmetic on them; it held
    the traced size (the pads, windows and resizes of the traced size frozen:
    wrong maps, so the graph was stopped at every other size), and the
    normaliser's key count was frozen at the traced one (off by 3e-2 where
    the eps counts). At mmdeploy's opset 11 (the formula's einsums needed
    12). With positional encodings drawn at random: torch.onnx had dropped
    their add (into a view of the q, k, v product) at every size. Swin stops where a stage's map fits in one window but
    did not at the traced size or the other way round (the release's own
    branch: no shift, and global linear attention, there)."""
    ort = pytest.importorskip('onnxruntime')
    model = no_zero_parameters(BACKBONES[kind][0](**BACKBONES[kind][1]).eval())
    path = str(tmp_path / f'{kind}.onnx')
    torch.onnx.export(model, (torch.randn(1, 3, 64, 72),), path, dynamo=False,
                      opset_version=11,  # mmdeploy's
                      input_names=['x'], dynamic_axes={'x': {0: 'batch', 2: 'h', 3: 'w'}})
    session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    # Swin at 64x72: stages 3 and 4 fit in a window (4x5, 2x3), as up to 112x112
    sizes = [(3, 64, 72), (1, 45, 77), (2, 1, 1), (1, 112, 112)]
    if kind != 'swin':
        sizes.append((1, 128, 160))
    for size in sizes:
        x = torch.randn(size[0], 3, *size[1:])
        with torch.no_grad():
            want = model(x)
        for a, b in zip(session.run(None, {'x': x.numpy()}), want, strict=True):
            torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-4, atol=1e-4)
    if kind == 'swin':
        for size in ((128, 160), (113, 64)):  # stage 3 of 8x10, 8x4: more than one window
            with pytest.raises(Exception, match='Expand'):
                session.run(None, {'x': torch.randn(1, 3, *size).numpy()})


@pytest.mark.filterwarnings('ignore::torch.jit.TracerWarning')  # the input checks' bools
@pytest.mark.parametrize('cls, kwargs, example', [
    # reduced keys exported where a stage's map and its reduced grid are both 1x1:
    # V's resize to the query grid was left out of the graph (a Reshape stopped it)
    (FLattenPVT, dict(sr_ratios=[2, 2, 2, 1]), (8, 3)),
    (FLattenPVT, dict(sr_ratios=[2, 2, 2, 1], attn_design='efficientvit'), (8, 3)),
    # EfficientViT's 2C channels take LePE in place in their first C: torch.onnx
    # wrote that add at the traced size (off by 4e-2 elsewhere, nothing failed)
    (FLattenCSwin, dict(attn_design='efficientvit'), (60, 54))])
def test_onnx_dynamic_axes_with_reduced_keys_and_designs(cls, kwargs, example, tmp_path):
    """Exported with dynamic axes at an example size, these graphs equal eager at
    other sizes (found by random cases: exported and run at random sizes)."""
    ort = pytest.importorskip('onnxruntime')
    base = dict(embed_dims=[16, 32, 48, 64], num_heads=[1, 2, 3, 4], depths=[1, 1, 1, 1],
                attn_type='LLLL') if cls is FLattenPVT else BACKBONES['cswin'][1]
    model = no_zero_parameters(cls(**dict(base, **kwargs)).eval())
    path = str(tmp_path / 'model.onnx')
    torch.onnx.export(model, (torch.randn(1, 3, *example),), path, dynamo=False,
                      opset_version=11, input_names=['x'],
                      dynamic_axes={'x': {0: 'batch', 2: 'h', 3: 'w'}})
    session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    for size in ((57, 66), (27, 7), (1, 1)):
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            want = model(x)
        for a, b in zip(session.run(None, {'x': x.numpy()}), want, strict=True):
            torch.testing.assert_close(torch.from_numpy(a), b, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings('ignore::torch.jit.TracerWarning')  # sizes become constants
@pytest.mark.parametrize('kind', sorted(BACKBONES))
def test_traced_graph_saves_and_loads(kind):
    """``torch.jit.trace`` as users call it (gradients on, the model in eval
    mode) records plain ops: the graph saves and loads (``torch.jit.save``
    refused the attention's autograd function: "Could not export Python
    function call"; mmdeploy's TorchScript backend deploys so), the loaded
    graph equals eager at any batch and still stops at another size."""
    model = BACKBONES[kind][0](**BACKBONES[kind][1]).eval()
    x = torch.randn(1, 3, 64, 72)
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.trace(model, x, check_trace=False), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    x = torch.randn(2, 3, 64, 72)
    with torch.no_grad():
        for a, b in zip(loaded(x), model(x), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match='only_at_traced_size'):
            loaded(torch.randn(1, 3, 64, 104))


@pytest.mark.filterwarnings('ignore::torch.jit.TracerWarning')  # sizes become constants
@pytest.mark.parametrize('name', ['flatten_pvt_tiny', 'flatten_swin_tiny'])
def test_torchscript_is_refused_clearly_and_trace_works(name):
    """torch.jit.script cannot compile the attention's autograd function:
    it fails with a message naming what works instead, not from deep in
    the compiler. torch.jit.trace records the ops at one image size (any
    batch); the graph stops at any other size, where it gave wrong logits
    (FLatten-PVT-T traced at 64x64, at 64x72: off by up to 0.29)."""
    model = timm.create_model(name, pretrained=False).eval()
    with pytest.raises(RuntimeError, match='do not support torch.jit.script.*torch.compile'):
        torch.jit.script(model)
    with pytest.raises(RuntimeError, match='do not support torch.jit.script'):
        torch.jit.script(FLattenPVT(arch='tiny', depths=[1, 1, 1, 1]))
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        traced = torch.jit.trace(model, x, check_trace=False)
        torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(2, 3, 64, 96)
        torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-5)
        for size in ((64, 104), (72, 96), (63, 96), (64, 1), (1, 96), (96, 64), (32, 192)):
            with pytest.raises(RuntimeError, match='only_at_traced_size'):
                traced(torch.randn(1, 3, *size))



@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
@pytest.mark.parametrize('kind', sorted(BACKBONES))
def test_cuda_equals_cpu(kind):
    """On a GPU, in training mode at an odd size: outputs and every
    parameter's gradient equal the CPU's (fp32, TF32 off); under bf16
    autocast the outputs stay finite and near fp32."""
    model = backbone(kind).train()
    x = torch.randn(2, 3, 57, 83, generator=torch.Generator().manual_seed(0))
    want, want_grads = loss_and_grads(model, x)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        model.cuda()
        got, got_grads = loss_and_grads(model, x.cuda())
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)
    assert_grads_close({n: g.cpu() for n, g in got_grads.items()}, want_grads, 1e-4)
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        outs = model(x.cuda())
    for a, b in zip(outs, want):
        assert torch.isfinite(a).all()
        assert ((a.float().cpu() - b).norm() / b.norm()).item() < 3e-2
