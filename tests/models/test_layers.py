"""Shared layers: the fused residual of DropPath, the MLP's chunked path, strided convs
on narrow maps."""
import pytest
import torch
from torch import nn

from flatten_mm.models.layers import DropPath, Mlp

from backbone_checks import calls_of, relative_error


def test_drop_path_with_residual_is_one_fused_sum():
    x, res = torch.randn(4, 5, 3), torch.randn(4, 5, 3)
    dp = DropPath(0.5).train()
    torch.manual_seed(0)
    fused = dp(x, res)
    torch.manual_seed(0)
    dropped = dp(x)
    torch.testing.assert_close(fused, res + dropped)
    # each sample's branch is dropped whole or kept scaled by 1 / keep
    dropped_whole = (dropped == 0).flatten(1).all(1)
    kept_scaled = torch.isclose(dropped, 2 * x).flatten(1).all(1)
    assert torch.all(dropped_whole | kept_scaled)
    dp.eval()
    assert torch.equal(dp(x, res), res + x)
    with torch.no_grad():  # inference: a new tensor, the branch's output left alone
        branch = x.clone()
        out = dp(branch, res)
    assert out.data_ptr() != branch.data_ptr() and torch.equal(out, res + x)
    assert torch.equal(branch, x)


@pytest.mark.parametrize('grad', [True, False])
def test_drop_path_sum_has_the_dtype_of_residual_plus_branch(grad):
    """A bf16 branch (autocast's linear) on an fp32 stream (autocast's
    LayerNorm on CUDA): the sum stays fp32 with or without gradients, as
    ``residual + x``; in place, inference made the stream bf16 from the first
    block on, unlike training and the official models."""
    res, x = torch.randn(2, 5, 3), torch.randn(2, 5, 3).bfloat16()
    dp = DropPath(0.1).eval()
    with torch.set_grad_enabled(grad):
        out = dp(x, res)
    assert out.dtype == torch.float32
    assert torch.equal(out, res + x)


def test_drop_path_in_training_adds_a_half_branch_as_the_official_models():
    """Training, a bf16 branch on an fp32 stream: ``residual + drop_path(x)``
    as timm's and the release's DropPath (the scaled branch in bf16, the sum
    fp32). Not one addcmul of both dtypes: CUDA's autocast promotes its inputs
    to one dtype first, an fp32 copy of every branch of every block (2% of
    FLatten-PVT-T's training traffic)."""
    res, x = torch.randn(4, 5, 3), torch.randn(4, 5, 3).bfloat16()
    dp = DropPath(0.5).train()
    torch.manual_seed(0)
    outs = []
    calls = calls_of(torch.ops.aten.addcmul, lambda: outs.append(dp(x, res)))
    out = outs[0]
    torch.manual_seed(0)
    assert out.dtype == torch.float32 and torch.equal(out, res + dp(x))
    mixed = [args for args in calls if len({a.dtype for a in args}) > 1]
    assert not mixed


@pytest.mark.parametrize('grad', [True, False])
def test_mlp_chunked_path_equals_plain(grad):
    torch.manual_seed(0)
    mlp = Mlp(8, 32)
    x = torch.randn(2, 3000, 8)
    assert mlp._chunked(x)
    with torch.set_grad_enabled(grad):
        got = mlp(x)
    mlp._chunked = lambda x: False
    with torch.set_grad_enabled(grad):
        ref = mlp(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # paths that keep the plain ops: depth-wise conv, dropout in training, autocast
    assert not Mlp(8, 32, with_dwconv=True)._chunked(x)
    assert not Mlp(8, 32, drop=0.1).train()._chunked(x)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert not Mlp(8, 32)._chunked(x)


@pytest.mark.parametrize('where', ['pvtv2-patch-embed', 'pvtv2-first-embed', 'cswin-merge'])
def test_strided_convs_on_narrow_maps_train_in_bf16(where):
    """PyTorch's CPU bf16 convolution returns wrong weight gradients for a
    strided conv whose output is one pixel wide, unless its input is as wide
    as such an output allows (finite, far off: a stride-2 3x3 conv on width 1,
    75 of 100 tries; PVTv2's first 7x7 stride-4 embedding on widths 1-3);
    PVTv2's patch embeddings and CSwin's merges add zero columns there, which
    change no output. Under bf16 autocast the weight gradient is fp32's within
    bf16's rounding (5 %) in each try, contiguous and channels-last."""
    from flatten_mm.models.backbones.flatten_cswin import MergeBlock
    from flatten_mm.models.layers import PatchEmbed
    if where == 'cswin-merge':
        layer = MergeBlock(16, 32)

        def run(x):
            return layer(x.flatten(2).transpose(1, 2), x.shape[2:])[0]
        conv, widths = layer.conv, (1,)
    else:
        first = where == 'pvtv2-first-embed'
        layer = PatchEmbed(16, 32, patch_size=7 if first else 3, stride=4 if first else 2)

        def run(x):
            return layer(x)[0]
        conv, widths = layer.proj, (1, 2, 3) if first else (1,)
    tries = [(t, width, layout) for t in range(4) for width in widths
             for layout in (torch.contiguous_format, torch.channels_last)]
    for t, width, layout in tries:
        x = torch.randn(2, 16, 3 + t, width).contiguous(memory_format=layout)
        grads = []
        for half in (False, True):
            layer.zero_grad()
            with torch.autocast('cpu', dtype=torch.bfloat16, enabled=half):
                out = run(x)
            (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            grads.append(conv.weight.grad.clone())
        assert out.shape[1] == -(-x.shape[2] // conv.stride[0])  # one column
        err = relative_error(grads[1], grads[0])
        assert err < 0.05, (t, tuple(x.shape), layout, err)


@pytest.mark.parametrize('where', ['deit-patch-embed', 'pvt-key-reduction'])
def test_strided_convs_on_narrow_channels_last_maps_in_bf16(where):
    """PyTorch's CPU bf16 convolution gets a conv with kernel = stride wrong
    (about 100 % off) on a channels-last map that gives an output one pixel
    wide, for some channel counts under 32: DeiT's patch embedding of
    4-channel images and PVT's key reduction (sr_ratio 8, 16 channels; token
    maps are channels-last) meet it. They widen such maps with zero columns
    (the conv never reaches them): bf16 outputs within 5 % of fp32's, in
    inference and in training, for every height tried."""
    from flatten_mm.models.backbones.flatten_deit import ViTPatchEmbed
    from flatten_mm.models.utils import spatial_reduce
    if where == 'deit-patch-embed':
        layer = ViTPatchEmbed(4, 32, 16)

        def run(x):
            return layer(x)[0]
        inputs = [torch.randn(2, 4, h, 16).contiguous(memory_format=torch.channels_last)
                  for h in (16, 40, 48)]
    else:
        layer = nn.Module()
        layer.sr, layer.norm, layer.sr_ratio = nn.Conv2d(16, 16, 8, 8), nn.LayerNorm(16), 8

        def run(x):
            return spatial_reduce(x, (x.shape[1] // 8, 8), layer)[0]
        inputs = [torch.randn(2, h * 8, 16) for h in (8, 20, 24)]
    for x in inputs:
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                ref = run(x)
                with torch.autocast('cpu', dtype=torch.bfloat16):
                    out = run(x).float()
            err = relative_error(out, ref)
            assert err < 0.05, (tuple(x.shape), grad, err)
