"""tools/analysis_tools/launch_count.py: the Triton ops counted by the kernels
they launch (on fake CUDA tensors, nothing run), each launch by the tensors
its kernel uses under the launch's compile-time flags.

Counted as one op each, a layer's attention read q and k once; its kernels
read them twice (statistics, then state or output pass), and the backward's
passes q, g, k and v once or twice."""

import pytest
import torch

from flatten_mm.models.ops import available_backends

from analysis_tool import load_tool

pytestmark = pytest.mark.skipif('triton' not in available_backends(), reason='needs triton')


def test_a_kernels_flags_decide_which_tensors_it_uses():
    """Read from the kernel's source: a pointer used only under ``if FLAG:`` (or
    its else branch, or ``if not FLAG:``) counts only when the launch sets the
    flag so; a pointer handed to a helper outside such a block always counts."""
    from flatten_mm.models.ops import triton_backend
    lc = load_tool('launch_count')
    ks = triton_backend.kernels()

    def pointers(fn, **flags):
        return {name for name in lc.used_params(fn, flags) if name.endswith('_ptr')}
    key_grad = ks._key_grad_kernel.fn
    several = pointers(key_grad, WHOLE_ROWS=False, HAS_MASK=False)
    one = pointers(key_grad, WHOLE_ROWS=True, HAS_MASK=False)
    assert several - one == {'gc_ptr'} and one - several == {'dv_ptr'}
    assert {'k_ptr', 'v_ptr', 'mask_ptr', 'dk_ptr', 'ds_ptr'} <= several  # mask: in a helper
    query_grad = ks._query_grad_kernel.fn
    unfused = pointers(query_grad, WHOLE_ROWS=False)
    assert pointers(query_grad, WHOLE_ROWS=True) - unfused == {'dkv_ptr', 'dkm_ptr'}

    def kernel(x_ptr, y_ptr, z_ptr, A: 'tl.constexpr'):
        if not A:
            x_ptr = y_ptr
        return x_ptr + z_ptr
    assert lc.used_params(kernel, dict(A=True)) == ['x_ptr', 'z_ptr']
    assert lc.used_params(kernel, dict(A=False)) == ['x_ptr', 'y_ptr', 'z_ptr']
    assert lc.used_params(kernel, {}) == ['x_ptr', 'y_ptr', 'z_ptr']  # flag unknown: used


def count_layer(heads, masked=False):
    """The tallies of one fp32 layer's forward and backward, 2 images of 5x6
    tokens, 32 channels, the core and DWC on the Triton ops (fake CUDA); with
    ``masked``, a key mask (padded windows' keys) given."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flatten_mm.models import FocusedLinearAttention
    trace_cuda, lc = load_tool('trace_cuda'), load_tool('launch_count')
    pb = load_tool('profile_backbone')
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    layer = trace_cuda.to_fake_cuda(FocusedLinearAttention(32, heads), fake_mode)
    with trace_cuda.on_fake_gpu(fake_mode, 'triton'), lc.counted_launches() as inside:
        x = torch.randn(2, 30, 32, device='cuda')
        mask = torch.arange(30, device='cuda').expand(2, 30) < 27 if masked else None
        outs = []
        forward = pb.tally_ops(lambda: outs.append(layer(x, (5, 6), mask).sum()), inside)
        backward = pb.tally_ops(lambda: trace_cuda.run_backward(outs[0]), inside)
    return forward, backward


def test_a_layers_kernels_counted_by_hand():
    """Two heads of 16 channels: 1/scale made once from the raw scale, q's and
    k's statistics passes, the state pass, the output pass (reading q, its
    statistics, 1/scale, KV and km, writing out: bytes by hand), the fused DWC;
    backward's four passes and the conv's three. With one head the token
    kernels make the statistics and fuse the passes: no statistics pass, two
    attention passes in backward (on sm_90)."""
    forward, backward = count_layer(2)
    assert not any(op.startswith('flatten_mm::') for op in {**forward.calls, **backward.calls})
    assert {op: n for op, n in forward.calls.items() if op.startswith('triton::')} == {
        'triton::inverse_scale': 1, 'triton::row_stats': 2, 'triton::kv_state': 1,
        'triton::state_sum': 1, 'triton::output': 1, 'triton::conv_add': 1}
    B, N, C, h, d, f32 = 2, 30, 32, 2, 16, 4
    assert forward.bytes['triton::output'] == f32 * (
        B * N * C + 3 * B * N + C + B * h * d * d + B * h * d + B * N * C)
    assert forward.bytes['triton::row_stats'] == 2 * f32 * (B * N * C + C + 3 * B * N)
    assert forward.bytes['triton::inverse_scale'] == f32 * 2 * C  # scale read, 1/scale written
    # k, v, k's statistics (also the absent mask's stand-in: once), 1/scale, and
    # the partial states of one chunk (30 keys: one block)
    assert forward.bytes['triton::kv_state'] == f32 * (
        2 * B * N * C + 3 * B * N + C + B * h * d * d + B * h * d)
    assert {op: n for op, n in backward.calls.items() if op.startswith('triton::')} == {
        'triton::query_state_grad': 1, 'triton::query_grad': 1, 'triton::state_sum': 1,
        'triton::key_value_grad': 1, 'triton::key_grad': 1, 'triton::conv_add': 1,
        'triton::conv_weight_grad': 1, 'triton::conv_grad_sum': 1}
    # the chunks' partial states (and their gradients) summed and divided by the key
    # count in one kernel, 1 / n a scalar: no torch sum, count or scaling in the forward
    # (its one sum the loss's), and none left to the backward but the scale's one sum
    assert forward.calls['aten::sum'] == 1 and 'aten::mul_' not in forward.calls
    assert 'aten::full' not in forward.calls and 'aten::full' not in backward.calls
    # the DWC read from its one head's kernel: no repeat forward, and its gradient summed
    # over the heads in the kernel that sums the chunks (no clone of torch's)
    assert 'aten::repeat' not in forward.calls
    assert 'aten::clone' not in backward.calls, backward.calls
    # unmasked, the attention and its DWC are one op: their gradients of q, k and v
    # written into the product's gradient, v's two added in place (no cat, no add)
    aten = {op: n for op, n in backward.calls.items() if op.startswith('aten::')}
    assert 'aten::cat' not in aten and 'aten::add' not in aten, aten
    # a key mask: two ops; the forward's state sum counts each image's keys and keeps
    # 1 / count for the backward's key passes: its ATen ops are the unmasked layer's,
    # the gradient of V's masking and the two ops' joins (no sum, clamp and
    # division of the mask's there)
    _, masked = count_layer(2, masked=True)
    assert {op: n for op, n in masked.calls.items() if op.startswith('aten::')} == {
        **aten, 'aten::mul': aten.get('aten::mul', 0) + 1, 'aten::cat': 1,
        'aten::add': 1}, masked.calls
    forward, backward = count_layer(1)
    assert 'triton::row_stats' not in forward.calls
    assert {op for op in backward.calls if op.startswith('triton::')} == {
        'triton::query_grad', 'triton::state_sum', 'triton::key_grad', 'triton::conv_add',
        'triton::conv_weight_grad', 'triton::conv_grad_sum'}


def test_what_a_launch_leaves_uncounted_its_kernel_does_not_touch():
    """Under Triton's interpreter, each launch of a layer's forward and backward
    (two heads, with and without a key mask; one head) runs again with every
    tensor the count leaves out (used only under flags the launch does not
    set, and not also passed in a slot it uses) filled with NaN: the kernel's
    other tensors come out bit-identical, and the NaN ones unwritten."""
    from flatten_mm.models import FocusedLinearAttention
    from flatten_mm.models.ops import triton_backend, use_backend
    if not triton_backend.interpreted():
        pytest.skip('runs the kernels under the interpreter')
    lc = load_tool('launch_count')
    left_out = set()

    def rerun(name, kernel, grid, args, kwargs):  # then again, the uncounted poisoned
        params, _ = lc.param_uses(kernel.fn)
        given = dict(zip(params, args), **kwargs)
        tensors = {n: t for n, t in given.items() if isinstance(t, torch.Tensor)}
        used = {id(tensors[n]) for n in lc.used_params(kernel.fn, given) if n in tensors}
        left = [n for n, t in tensors.items() if id(t) not in used]
        before = {n: t.clone() for n, t in tensors.items()}
        kernel[grid](*args, **kwargs)
        if not left:
            return
        after = {n: t.clone() for n, t in tensors.items()}
        for n, t in tensors.items():  # tensors only read stay unwritten (autograd saves some)
            if n in left or not torch.equal(t, before[n]):
                t.copy_(before[n] if n not in left else torch.full_like(t, float('nan')))
        kernel[grid](*args, **kwargs)
        for n, t in tensors.items():
            if n in left:
                assert torch.isnan(t).all(), (name, n)
            else:
                assert torch.equal(t, after[n]), (name, n)
            if not torch.equal(t, after[n]):
                t.copy_(after[n])
        left_out.add((name, tuple(sorted(left))))
    x = torch.randn(2, 30, 32)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 20:] = False
    with use_backend('triton'), lc.launches_recorded(rerun):
        for heads, key_mask in ((2, None), (2, mask), (1, None)):
            layer = FocusedLinearAttention(32, heads)
            layer(x, (5, 6), key_mask).square().sum().backward()
    # the exclusions the counts rest on were exercised
    assert {('_key_grad_kernel', ('dv_ptr', )),
            ('_query_grad_kernel', ('dkm_ptr', 'dkv_ptr'))} <= left_out, left_out
