"""FLOP counting and saved-bytes measurement (flatten_mm.analysis)."""
import pytest
import torch
import torch.nn.functional as F

from flatten_mm import FocusedLinearAttention
from flatten_mm.models.ops import available_backends, use_backend
from flatten_mm.analysis import (FOCUS_OPS_PER_ELEMENT, flop_analyzer, focusing_ops,
                                 saved_tensor_bytes)


class Call(torch.nn.Module):
    def __init__(self, module, *extra):
        super().__init__()
        self.module = module
        self.extra = extra

    def forward(self, x):
        return self.module(x, *self.extra)


def test_one_attention_layer_matches_a_hand_count():
    C, h, H, W, k = 64, 2, 10, 12, 5
    d, N = C // h, H * W
    m = FocusedLinearAttention(C, h, kernel_size=k, pos_grid=(H, W)).eval()
    analyzer = flop_analyzer(Call(m, (H, W)), (torch.randn(1, N, C),))
    by_op = analyzer.by_operator()
    assert by_op['linear'] == 4 * N * C * C  # q, k, v, proj
    # phi(K)^T V: n d^2 per head; key mean: n d; q . mean: N d; phi(Q) KV: N d^2
    assert by_op['focused_linear_attention'] == h * (N * d * d + N * d + N * d + N * d * d)
    assert by_op['conv'] == N * C * k * k  # the DWC
    assert analyzer.total() == sum(by_op.values()) == 4 * N * C * C + h * (
        2 * N * d * d + 2 * N * d) + N * C * k * k


def test_mmengines_own_analyzer_counts_the_attention_products():
    """mmengine's FlopAnalyzer without our handles (mmdet's and mmseg's
    get_flops.py) traces the formula's plain ops: it counts phi(K)^T V,
    phi(Q)(phi(K)^T V) and the normaliser's phi(Q) mean(phi(K)) as matmuls,
    exactly (it counted nothing for the attention core's node before), the key
    mean and the focusing map not at all."""
    from mmengine.analysis import FlopAnalyzer
    C, h, H, W = 64, 2, 10, 12
    d, N = C // h, H * W
    m = Call(FocusedLinearAttention(C, h, pos_grid=(H, W)).eval(), (H, W))
    x = torch.randn(1, N, C)
    ours = flop_analyzer(m, (x,)).by_operator()
    plain = FlopAnalyzer(m, (x,)).unsupported_ops_warnings(False).by_operator()
    assert plain['matmul'] == h * (2 * N * d * d + N * d) < ours['focused_linear_attention']
    assert plain['linear'] == ours['linear'] and plain['conv'] == ours['conv']


def test_spatial_reduction_counts_the_reduced_keys():
    C, h, H, W, r = 32, 1, 8, 12, 2
    N, n = H * W, (H // r) * (W // r)
    m = FocusedLinearAttention(C, h, sr_ratio=r, pos_grid=(H // r, W // r)).eval()
    by_op = flop_analyzer(Call(m, (H, W)), (torch.randn(1, N, C),)).by_operator()
    assert by_op['linear'] == 2 * N * C * C + 2 * n * C * C  # q, proj on N; k, v on n
    assert by_op['focused_linear_attention'] == n * C * C + n * C + N * C + N * C * C
    assert by_op['conv'] == n * C * C * r * r + N * C * 25  # reduction conv + DWC


@pytest.mark.filterwarnings('ignore::torch.jit.TracerWarning')
@pytest.mark.skipif('triton' not in available_backends(), reason='needs triton')
def test_triton_backend_counts_as_the_torch_backend():
    """The triton backend's custom ops (attention, and out + DWC(V)) have their
    own handles: a model counts the same FLOPs whichever backend runs its
    attention (under the interpreter here)."""
    C, h, H, W, r = 32, 2, 6, 10, 2
    m = FocusedLinearAttention(C, h, sr_ratio=r, pos_grid=(H // r, W // r)).eval()
    x = torch.randn(2, H * W, C)
    counts = {}
    for backend in ('torch', 'triton'):
        with use_backend(backend):
            counts[backend] = flop_analyzer(Call(m, (H, W)), (x,)).by_operator()
    N, n, d = H * W, (H // r) * (W // r), C // h
    assert counts['triton']['focused_linear_attention'] == 2 * h * (
        n * d * d + n * d + N * d + N * d * d)
    # the 5 x 5 DWC of V on the query grid, and the key reduction's r x r conv
    assert counts['triton']['conv'] == 2 * N * C * 5 * 5 + 2 * n * C * C * r * r
    assert counts['triton'] == counts['torch']


@pytest.mark.parametrize('kernel_size', [5, 1])
def test_triton_backend_counts_the_dwc_and_lepe_as_one_conv(kernel_size):
    """CSwin's DWC and LePE, given to the fused op as parts, count as one conv
    of the larger kernel, as the merged kernel's conv on the torch backend."""
    C, h, H, W = 32, 2, 6, 10
    m = FocusedLinearAttention(C, h, lepe=True, kernel_size=kernel_size,
                               pos_grid=(H, W)).eval()
    x = torch.randn(2, H * W, C)
    counts = {}
    for backend in ('torch', 'triton'):
        with use_backend(backend):
            counts[backend] = flop_analyzer(Call(m, (H, W)), (x,)).by_operator()
    k = max(kernel_size, 3)
    assert counts['triton']['conv'] == 2 * H * W * C * k * k
    assert counts['triton'] == counts['torch']


def test_softmax_attention_is_counted():
    q = torch.randn(2, 3, 10, 8)
    k = torch.randn(2, 3, 14, 8)

    class SDPA(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, k, k)

    assert flop_analyzer(SDPA(), (q,)).total() == 2 * 3 * 10 * 14 * (8 + 8)


def test_focusing_ops_per_element_of_q_and_k():
    m = FocusedLinearAttention(16, 2, sr_ratio=2, pos_grid=(3, 3))
    x = torch.randn(2, 5 * 6, 16)
    # 30 queries and ceil(5/2) * ceil(6/2) = 9 keys per image
    assert focusing_ops(m, lambda: m(x, (5, 6))) == FOCUS_OPS_PER_ELEMENT * 16 * 2 * (30 + 9)


def test_saved_bytes_count_storages_once_and_skip_excluded():
    x = torch.randn(100, requires_grad=True)
    w = torch.randn(100, requires_grad=True)

    def fn():
        y = x.exp()  # saves its result: 400 bytes
        return (y * w).sum() + y[:10].sin().sum()  # y again (as a view) and w

    _, nbytes = saved_tensor_bytes(fn, [x, w])
    # exp's result (once, although also saved through the view) and sin's input slice
    assert nbytes == 400
    _, with_w = saved_tensor_bytes(fn, [x])
    assert with_w == 800


def test_saved_bytes_of_fake_tensors_equal_real_ones(monkeypatch):
    """Fake tensors (no memory, address 0: how trace_cuda.py counts a GPU
    step's activations) give the count real ones give, for a FLatten layer's
    second training step (the first fills its caches, as the tool's), with
    fake weights and the tensor caches kept under the fake mode, as the tool
    has them."""
    import copy
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flatten_mm.models import utils
    monkeypatch.setattr(utils, '_under_tensor_mode', lambda: False)
    torch.manual_seed(0)
    layer = FocusedLinearAttention(32, 2, sr_ratio=2, pos_grid=(6, 10)).train()
    other = copy.deepcopy(layer)
    x = torch.randn(2, 60, 32, requires_grad=True)
    for _ in range(2):
        _, real = saved_tensor_bytes(lambda: layer(x, (6, 10)), [x, *layer.parameters()])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_x = mode.from_tensor(x)
        for module in other.modules():  # fake weights, as the tool's
            for name, p in list(module._parameters.items()):
                module._parameters[name] = torch.nn.Parameter(mode.from_tensor(p.detach()))
        for _ in range(2):
            _, fake = saved_tensor_bytes(lambda: other(fake_x, (6, 10)),
                                         [fake_x, *other.parameters()])
    assert real > 60 * 32 * 4 and fake == real
