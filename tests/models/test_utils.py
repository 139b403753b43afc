"""flatten_mm/models/utils.py: the modules' tensor caches."""
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from flatten_mm.models.utils import CACHE_SIZE, autocast_input, branch_on_sizes, size_cached


class Counted:
    """``make`` for size_cached: a fresh tensor per call, counted."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return torch.arange(4)


def test_size_cache_serves_training_and_inference_alike():
    module, make = nn.Linear(1, 1).train(), Counted()
    first = size_cached(module, ('mask', 4), make)
    assert size_cached(module, ('mask', 4), make) is first  # training, gradients on
    with torch.no_grad():
        assert size_cached(module.eval(), ('mask', 4), make) is first
    assert make.calls == 1
    # None (no padding, say) is a value like any other
    calls = []
    for _ in range(2):
        assert size_cached(module, ('none', ), lambda: calls.append(1)) is None
    assert len(calls) == 1


def test_size_cache_keeps_inference_tensors_apart():
    """A tensor made under inference_mode cannot be saved for backward: a
    training step never gets one."""
    module, make = nn.Linear(1, 1), Counted()
    with torch.inference_mode():
        inference = size_cached(module, ('w', ), make)
    w = size_cached(module, ('w', ), make)
    assert inference.is_inference() and not w.is_inference() and make.calls == 2
    x = torch.ones(4, requires_grad=True)
    (x * w.float()).sum().backward()  # w saved for backward
    assert torch.equal(x.grad, torch.arange(4.))


def test_size_cache_holds_the_last_entries_only():
    module, make = nn.Linear(1, 1), Counted()
    for size in range(CACHE_SIZE + 3):
        size_cached(module, ('mask', size), make)
    assert len(module.__dict__['_tensor_cache']) == CACHE_SIZE
    size_cached(module, ('mask', CACHE_SIZE + 2), make)  # still held
    size_cached(module, ('mask', 0), make)  # evicted: made again
    assert make.calls == CACHE_SIZE + 4


def test_fake_and_proxy_tensors_are_never_cached():
    """Tensors made under a fake mode (shape propagation) or make_fx must not
    outlive it: a later real call gets a real tensor."""
    module = nn.Linear(1, 1)
    with FakeTensorMode():
        assert isinstance(size_cached(module, ('mask', ), Counted()), FakeTensor)
    make_fx(lambda x: x + size_cached(module, ('mask', ), Counted()))(torch.zeros(4))
    assert '_tensor_cache' not in module.__dict__
    real = size_cached(module, ('mask', ), Counted())
    assert type(real) is torch.Tensor and torch.equal(real, torch.arange(4))


def test_autocast_input_casts_as_autocast_casts_a_matmul_input():
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    assert autocast_input(x) is x  # autocast off
    with torch.autocast('cpu', dtype=torch.bfloat16):
        for t in (x, x.half()):
            cast = autocast_input(t)
            assert cast.dtype == torch.bfloat16
            assert torch.equal(torch.nn.functional.linear(cast, w),
                               torch.nn.functional.linear(t, w))
        assert autocast_input(x.double()).dtype == torch.float64  # autocast leaves fp64
        assert autocast_input(torch.ones(3, dtype=torch.long)).dtype == torch.long
        meta = torch.empty(3, 4, device='meta')  # a device without autocast
        assert autocast_input(meta) is meta


def test_copies_of_a_module_start_with_an_empty_cache():
    """An eval forward caches the positional encoding resized along rows only:
    a view of the parameter, made without gradient. After an in-place update
    of the parameter (an optimizer or EMA step) autograd refuses to deep-copy
    that view, so ``copy.deepcopy(model)`` (EMA and teacher models, model
    soups) failed. Copies and pickles start empty; the copy computes what the
    original does."""
    import copy
    import pickle
    from flatten_mm import FocusedLinearAttention
    layer = FocusedLinearAttention(8, 1, pos_grid=(6, 3)).eval()
    x = torch.randn(1, 4 * 3, 8)
    with torch.no_grad():
        layer(x, (4, 3))  # key grid (4, 3): only rows resized
        assert layer.__dict__['_tensor_cache']
        for p in layer.parameters():
            p.add_(0.01)
    twin = copy.deepcopy(layer)
    assert not twin.__dict__['_tensor_cache']
    assert not pickle.loads(pickle.dumps(layer)).__dict__['_tensor_cache']
    with torch.no_grad():
        assert torch.equal(twin(x, (4, 3)), layer(x, (4, 3)))


def test_op_nodes_are_kept_in_this_threads_traces_only():
    """Inside ``op_nodes_in_traces`` (the FLOP analyzer's trace) a jit trace
    keeps the attention core's nodes; a trace in another thread meanwhile
    records plain ops (as for ``torch.jit.save``), and so does this thread's
    after the block."""
    import threading
    from flatten_mm.models import utils

    def seen(result: list, key: str):
        def fn(x):
            result.append((key, torch.jit.is_tracing(), utils.in_export_trace()))
            return x + 1
        torch.jit.trace(fn, torch.zeros(1), check_trace=False)

    result: list = []
    with utils.op_nodes_in_traces():
        seen(result, 'inside')
        thread = threading.Thread(target=seen, args=(result, 'other thread'))
        thread.start()
        thread.join()
    seen(result, 'after')
    assert sorted(result) == [('after', True, True), ('inside', True, False),
                              ('other thread', True, True)]
    assert not utils.in_export_trace()  # not tracing


class SizeBranch(torch.nn.Module):
    """Doubles (B, W, C) rows of more than 4 tokens (a branch on the image size)."""

    def forward(self, x):
        x, wide = branch_on_sizes(x, x.shape[1] > 4)
        return x * 2 if wide else x


@pytest.mark.filterwarnings('ignore::torch.jit.TracerWarning')
def test_a_branch_on_sizes_stops_an_onnx_graph_where_it_goes_the_other_way(tmp_path):
    """Eager: x and the bool as they are. Exported by torch.onnx's TorchScript
    exporter with dynamic axes at a width of 8: the graph runs at any width
    over 4 and stops (onnxruntime's error) at 4 or less, where eager takes the
    other branch; a plain jit trace's graph stops there too. One channel is
    refused: Expand would broadcast it, checking nothing."""
    ort = pytest.importorskip('onnxruntime')
    x = torch.randn(2, 5, 3)
    assert branch_on_sizes(x, False) == (x, False)
    path = str(tmp_path / 'branch.onnx')
    torch.onnx.export(SizeBranch(), (torch.randn(1, 8, 3),), path, dynamo=False,
                      input_names=['x'], dynamic_axes={'x': {0: 'b', 1: 'w'}})
    session = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    for width in (5, 8, 31):
        x = torch.randn(2, width, 3)
        torch.testing.assert_close(torch.from_numpy(session.run(None, {'x': x.numpy()})[0]),
                                   2 * x)
    for width in (1, 4):
        with pytest.raises(Exception, match='Expand'):
            session.run(None, {'x': torch.randn(2, width, 3).numpy()})
    traced = torch.jit.trace(SizeBranch(), torch.randn(1, 8, 3))  # a plain trace too
    x = torch.randn(2, 5, 3)
    torch.testing.assert_close(traced(x), 2 * x)
    with pytest.raises(RuntimeError, match='expand'):
        traced(torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match='more than 1 channel last, got 1'):
        torch.onnx.export(SizeBranch(), (torch.randn(1, 8, 1),), str(tmp_path / 'one.onnx'),
                          dynamo=False)
