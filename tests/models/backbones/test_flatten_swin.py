import pytest
import torch

from flatten_mm import FLattenSwin
from flatten_mm.models.backbones.flatten_swin import PatchMerging, SwinBlock
from flatten_mm.models.layers import (window_key_mask, window_layout, window_merge,
                                      window_partition)

from backbone_checks import (assert_autocast_finite, assert_caches_reused,
                             assert_cp_gives_same_gradients, assert_trains_at_every_size)


def small_swin(**kw):
    kw.setdefault('embed_dims', 16)
    kw.setdefault('num_heads', [1, 2, 2, 4])
    kw.setdefault('depths', [2, 2, 2, 2])
    m = FLattenSwin(**kw)
    m.init_weights()
    return m


@pytest.mark.parametrize('kw', [{}, dict(linear_window=7), dict(attn_type='SSSS'),
                                dict(attn_type='LLLL', linear_window=5)])
@pytest.mark.parametrize('hw', [(97, 131), (64, 64), (13, 6)])
def test_any_input_size(kw, hw):
    m = small_swin(**kw).eval()
    with torch.no_grad():
        outs = m(torch.randn(2, 3, *hw))
    assert [o.shape[1] for o in outs] == [16, 32, 64, 128]
    for o, s in zip(outs, (4, 8, 16, 32)):
        assert tuple(o.shape[2:]) == (-(-hw[0] // s), -(-hw[1] // s))
        assert torch.isfinite(o).all()
        # plain NCHW memory: compiled ops such as mmcv's CPU RoIAlign read it raw
        assert o.is_contiguous()


@pytest.mark.parametrize('kw', [{}, dict(attn_type='LLLL', linear_window=5)])
def test_trains_at_every_size(kw):
    assert_trains_at_every_size(small_swin(**kw))


def test_partition_round_trip():
    x = torch.randn(2, 10, 13, 4)
    windows, layout = window_partition(x, (7, 7), (4, 4))
    assert windows.shape == (2 * 2 * 3, 49, 4)  # (4 + 10) x (4 + 13 + 4) padded
    mask = window_key_mask((10, 13), (7, 7), layout, 2, x.device)
    assert mask.shape == (12, 49) and mask.sum() == 2 * 10 * 13
    # the mask marks exactly the windows' real tokens
    assert torch.equal(windows.abs().sum(-1) > 0, mask)
    assert window_key_mask((14, 21), (7, 7), window_layout((14, 21), (7, 7)), 2, x.device) is None
    assert torch.equal(window_merge(windows, (7, 7), (10, 13), layout), x)


@pytest.mark.parametrize('attn_type', ['L', 'S'])
def test_shifted_windows_never_join_opposite_borders(attn_type):
    """Swin's cyclic shift puts the top-left and bottom-right corners in one
    window; the release's linear blocks then let them attend to each other."""
    block = SwinBlock(16, 2, attn_type, window=(7, 7), shift=True, pos_grid=(7, 7),
                      focusing_factor=3, kernel_size=5).eval()
    H = W = 14
    x = torch.randn(1, H * W, 16)
    y = x.clone()
    y[0, 0] += 10.0  # perturb the top-left token
    with torch.no_grad():
        d = (block(y, (H, W)) - block(x, (H, W))).abs().sum(-1).view(H, W)
    assert d[0, 0] > 0
    # the shifted window of (0, 0) holds rows/cols 0..2 only
    assert d[3:].abs().max() == 0 and d[:, 3:].abs().max() == 0


@pytest.mark.parametrize('hw', [(4, 6), (5, 7), (1, 1), (3, 2)])
def test_patch_merging_concatenates_the_2x2_neighbours_in_swins_order(hw):
    """Swin's merge: the pixels at (row, column) offsets (0, 0), (1, 0), (0, 1)
    and (1, 1) of each 2x2 neighbourhood concatenated, odd maps zero-padded.
    Made as one permuted copy; output and gradient equal the four slices'."""
    merge = PatchMerging(4)
    H, W = hw
    x = torch.randn(2, H * W, 4, requires_grad=True)
    grid = torch.nn.functional.pad(x.view(2, H, W, 4), (0, 0, 0, W % 2, 0, H % 2))
    parts = [grid[:, i::2, j::2] for i, j in ((0, 0), (1, 0), (0, 1), (1, 1))]
    h, w = (H + 1) // 2, (W + 1) // 2
    want = merge.reduction(merge.norm(torch.cat(parts, -1).reshape(2, h * w, 16)))
    got, got_hw = merge(x, hw)
    assert got_hw == (h, w) and torch.equal(got, want)
    probe = torch.randn_like(got)
    assert torch.equal(*(torch.autograd.grad((y * probe).sum(), x)[0] for y in (got, want)))


def test_linear_window_padding_does_not_leak():
    """A 9x9 map in 7x7 windows: the top-left window equals the same
    attention run on the 7x7 crop alone; padded tokens change nothing."""
    block = SwinBlock(16, 2, 'L', window=(7, 7), shift=False, pos_grid=(7, 7),
                      focusing_factor=3, kernel_size=5).eval()
    x = torch.randn(1, 9, 9, 16)
    with torch.no_grad():
        full = block.attention(x.reshape(1, 81, 16), (9, 9)).view(9, 9, 16)
        crop = block.attn(x[:, :7, :7].reshape(1, 49, 16), (7, 7)).view(7, 7, 16)
        corner = block.attn(x[:, 7:, 7:].reshape(1, 4, 16), (2, 2))
    torch.testing.assert_close(full[:7, :7], crop, rtol=1e-5, atol=1e-6)
    assert corner.shape == (1, 4, 16) and torch.isfinite(full).all()


def test_softmax_window_on_small_map_equals_unpadded_window():
    block = SwinBlock(16, 2, 'S', window=(7, 7), shift=True, pos_grid=(7, 7),
                      focusing_factor=3, kernel_size=5).eval()
    torch.nn.init.normal_(block.attn.relative_position_bias_table)
    x = torch.randn(1, 5 * 4, 16)
    with torch.no_grad():
        got = block.attention(x, (5, 4))
        # explicit: attention among the 20 real tokens with the bias sub-table
        attn = block.attn
        q, k, v = attn.qkv(x).view(1, 20, 3, 2, 8).permute(2, 0, 3, 1, 4)
        idx = torch.tensor([r * 7 + c for r in range(5) for c in range(4)])
        bias = attn.relative_position_bias_table[
            attn.relative_position_index[idx][:, idx].reshape(-1)].view(20, 20, 2).permute(2, 0, 1)
        a = ((q @ k.transpose(-2, -1)) * 8 ** -0.5 + bias).softmax(-1)
        want = attn.proj((a @ v).transpose(1, 2).reshape(1, 20, 16))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradients_frozen_and_cp():
    m = small_swin(drop_path_rate=0., frozen_stages=1)
    m.train()
    assert not any(p.requires_grad for p in m.patch_embed.parameters())
    assert not any(p.requires_grad for p in m.layers[0].parameters())
    outs = m(torch.randn(2, 3, 64, 64))
    sum(o.square().mean() for o in outs).backward()
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert_cp_gives_same_gradients(small_swin, torch.randn(1, 3, 64, 64))


@pytest.mark.parametrize('kwargs,match', [
    (dict(arch='large'), r"arch must be one of \['base', 'small', 'tiny'\], got 'large'"),
    (dict(attn_type='LLS'), 'attn_type must be a string of 4 letters'),
    (dict(attn_type='llss'), 'attn_type must be a string of 4 letters'),
    (dict(num_heads=[3, 6, 12, 25]), 'divisible by num_heads'),
    (dict(kernel_size=6), 'kernel_size must be odd'),
    (dict(window_size=0), 'window_size must be an int >= 1'),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FLattenSwin(**kwargs)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_autocast_scaled_inputs_are_finite(dtype):
    assert_autocast_finite(small_swin(), dtype, torch.randn(1, 3, 64, 64) * 100)


def test_bias_table_of_another_window_is_resized_on_load():
    """A 224 model's softmax blocks (window 7) load into the 384 model's
    (window 12): tables resized bicubically, as Swin fine-tunes at 384."""
    kw = dict(embed_dims=16, num_heads=[1, 2, 2, 4], depths=[2, 2, 2, 2])
    small = FLattenSwin(**kw)
    big = FLattenSwin(**kw, window_size=12, pretrain_img_size=384)
    with torch.no_grad():  # a ramp along the row offset: entry i * 13 + j holds i
        ramp = torch.arange(13).float().repeat_interleave(13)
        small.layers[2].blocks[0].attn.relative_position_bias_table.copy_(
            torch.stack([ramp, -ramp], 1))
    big.load_state_dict(small.state_dict())
    attn = big.layers[2].blocks[0].attn
    got = attn.relative_position_bias_table.view(23, 23, 2)
    assert got[11, 11, 0] == 6 and got[11, 11, 1] == -6  # the centre stays the centre
    assert (got[1:, :, 0] >= got[:-1, :, 0] - 1e-4).all()  # still rising along rows
    assert (got[:, 1:, 0] - got[:, :-1, 0]).abs().max() < 1e-4  # and flat along columns
    assert torch.equal(attn.relative_position_index,
                       FLattenSwin(**kw, window_size=12).layers[2].blocks[0]
                       .attn.relative_position_index)


@pytest.mark.parametrize('kw', [{}, dict(linear_window=7)])
def test_caches_size_dependent_tensors(kw):
    assert_caches_reused(small_swin(**kw))
