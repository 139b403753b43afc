"""flatten_mm.models.ops.interpreter: Triton's CPU interpreter patches
``triton.language`` once per launch and set of modules, not at every call of a
``@triton.jit`` function inside a kernel, and the kernels compute the same."""
import pytest
import torch

from flatten_mm.models import FocusedLinearAttention
from flatten_mm.models.ops import interpreter, use_backend
from flatten_mm.models.ops import triton_backend as tb

pytestmark = pytest.mark.skipif(not tb.AVAILABLE or not tb.interpreted(),
                                reason="without triton, or kernels compiled for a GPU")


@pytest.fixture
def patches(monkeypatch):
    """The triton functions the interpreter's own patching ran for, in order."""
    tb.kernels()  # (installs it)
    assert interpreter.install()
    calls, original = [], interpreter._STATE['original']

    def counted(fn):
        calls.append(fn.__name__)
        return original(fn)
    monkeypatch.setitem(interpreter._STATE, 'original', counted)
    return calls


def test_a_launch_patches_each_set_of_modules_once(patches):
    """Three programs, each calling ``tl.max`` (a jit function of
    triton.language.standard, whose globals hold other modules than the
    kernel's): the kernel's modules are patched at the launch and the
    standard library's at its first call, not at the next two. A launch that
    raises ends its own: the next is patched again and computes."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_max(x_ptr, out_ptr, N: tl.constexpr, FAIL: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        tl.static_assert(not FAIL, 'asked to fail')
        tl.store(out_ptr + offs, x * 0 + tl.max(x, axis=0))
    x, out = torch.arange(8.), torch.zeros(8)
    row_max[(3, )](x, out, N=8, FAIL=False)
    assert out.tolist() == [7.] * 8
    # (standard.py's globals gain triton.language at its first call: a second set)
    assert patches[0] == 'row_max' and 2 <= len(patches) <= 3 and set(patches[1:]) == {'max'}
    with pytest.raises(Exception, match='asked to fail'):
        row_max[(3, )](x, out, N=8, FAIL=True)
    patches.clear()
    row_max[(3, )](x + 1, out, N=8, FAIL=False)
    assert out.tolist() == [8.] * 8 and patches == ['row_max', 'max']


def test_kernels_compute_the_same_with_the_interpreters_own_patching(patches, monkeypatch):
    """A layer with a 5x5 conv of V (the attention and the conv kernels),
    forward and backward, bit for bit as with the interpreter patching at
    every call; that made 50 times the patching or more."""
    from triton.runtime import interpreter as triton_interpreter
    torch.manual_seed(0)
    layer = FocusedLinearAttention(32, 2)
    x = torch.randn(2, 6 * 5, 32, requires_grad=True)

    def step():
        layer.zero_grad()
        x.grad = None
        with use_backend('triton'):
            out = layer(x, (6, 5))
            out.square().sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]
    ours = step()
    ours_count = len(patches)
    patches.clear()
    monkeypatch.setattr(triton_interpreter, '_patch_lang', interpreter._STATE['original'])
    theirs = step()
    assert len(patches) >= 50 * ours_count, (len(patches), ours_count)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
