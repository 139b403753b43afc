"""tools/analysis_tools/visualize_attention.py draws the attention rows that
phi(Q) phi(K)^T gives, written out here from the layer's own weights."""
import os.path as osp
import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from demo_runs import ROOT
from official_format import write_official_checkpoint

sys.path.insert(0, osp.join(ROOT, 'tools', 'analysis_tools'))
import visualize_attention as tool  # noqa: E402

from flatten_mm import FLattenPVT  # noqa: E402


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp('vis')
    ckpt = str(d / 'flatten_pvt_t.pth')
    write_official_checkpoint(ckpt, 'flatten_pvt_tiny')
    from PIL import Image
    rng = np.random.default_rng(0)
    img = (rng.random((80, 96, 3)) * 255).astype(np.uint8)
    Image.fromarray(img).save(d / 'img.png')
    return ckpt, str(d / 'img.png'), d


def explicit_rows(layer, x, hw, queries):
    """Mean over heads of phi(q_i).phi(k_j) / sum_j phi(q_i).phi(k_j), from the
    layer's weights: q, keys (reduced if sr_ratio > 1) + positional encoding,
    phi_p."""
    C, h = layer.embed_dims, layer.num_heads
    q = layer.q(x)[0]
    grid = hw
    if layer.sr_ratio > 1:
        red = layer.sr(x.transpose(1, 2).reshape(1, C, *hw))
        grid, x = tuple(red.shape[2:]), layer.norm(red.flatten(2).transpose(1, 2))
    k = F.linear(x, layer.kv.weight[:C], layer.kv.bias[:C])[0] + \
        layer.positional_encoding_for(grid)[0]
    s = F.softplus(layer.scale).view(-1)

    def phi(t):
        a = (F.relu(t) + 1e-6) / s
        ap = a ** layer.focusing_factor
        return ap / ap.norm(dim=-1, keepdim=True) * a.norm(dim=-1, keepdim=True)
    pq, pk = phi(q[queries]).view(len(queries), h, -1), phi(k).view(k.shape[0], h, -1)
    scores = torch.einsum('phd,nhd->phn', pq, pk)
    rows = scores / scores.sum(-1, keepdim=True)
    return rows.mean(1), tuple(grid)


def test_drawn_rows_equal_explicit_attention(files, tmp_path):
    ckpt, image, _ = files
    out = str(tmp_path / 'attn.png')
    tool.main(['flatten_pvt_tiny', ckpt, image, '--layer', 'block1.1.attn', '--size', '64', '96',
               '--points', '0.5,0.5', '0.05,0.95', '1,0', '--out', out])
    drawn = np.load(str(tmp_path / 'attn.npz'))
    assert str(drawn['layer']) == 'block1.1.attn'
    assert tuple(drawn['query_grid']) == (16, 24) and tuple(drawn['grid']) == (16, 24)
    assert drawn['queries'].tolist() == [8 * 24 + 12, 15 * 24 + 1, 23]

    model = FLattenPVT(arch='tiny', init_cfg=dict(type='Pretrained', checkpoint=ckpt))
    model.init_weights()
    model.eval()
    caught = {}
    layer = model.block1[1].attn
    layer.register_forward_pre_hook(lambda m, a: caught.update(x=a[0], hw=tuple(a[1])))
    _, x = tool.load_image(image, (64, 96))
    with torch.no_grad():
        model(x)
        rows, grid = explicit_rows(layer, caught['x'], caught['hw'],
                                   torch.as_tensor(drawn['queries']))
    assert grid == (16, 24)
    np.testing.assert_allclose(drawn['focused_map'].reshape(3, -1), rows.numpy(),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(drawn['softmax_map'].reshape(3, -1).sum(-1), 1.0, rtol=1e-6)
    # the rows differ between queries: the map is not a constant
    assert np.abs(drawn['focused_map'][0] - drawn['focused_map'][1]).max() > 1e-4

    from PIL import Image
    assert Image.open(out).size == (900, 900)  # 3 queries x 3 panels at 300 px


def test_layers_listing_and_clear_errors(files, tmp_path, capsys):
    ckpt, image, _ = files
    tool.main(['flatten_pvt_tiny', ckpt, image, '--list-layers'])
    assert torch.is_grad_enabled()  # the tool turns gradients off for itself only
    layers = capsys.readouterr().out.split()
    assert layers[0] == 'block1.0.attn' and len(layers) == 2 + 2 + 2 + 2
    with pytest.raises(SystemExit, match="no focused attention layer 'block9.attn'; choose from"):
        tool.main(['flatten_pvt_tiny', ckpt, image, '--layer', 'block9.attn',
                   '--out', str(tmp_path / 'a.png')])
    with pytest.raises(SystemExit, match=r"point '1.5,0.2' lies outside the image"):
        tool.main(['flatten_pvt_tiny', ckpt, image, '--points', '1.5,0.2'])
    with pytest.raises(SystemExit, match="unknown model 'flatten_vit'"):
        tool.main(['flatten_vit', ckpt, image])
    with pytest.raises(SystemExit, match='image not found'):
        tool.main(['flatten_pvt_tiny', ckpt, str(tmp_path / 'none.png')])


@pytest.mark.parametrize('kwargs, listed', [(dict(attn_design='hydra'), "['hydra']"),
                                             (dict(attn_type='SSSS'), 'none')])
def test_a_model_without_focused_layers_is_named(files, tmp_path, kwargs, listed):
    """Another design (configs/attention_designs) or softmax stages only: a
    message naming what the model has (was a ValueError traceback from deep
    in the analysis, or an IndexError)."""
    _, image, _ = files
    ckpt = str(tmp_path / 'other.pth')
    torch.save(FLattenPVT(arch='tiny', **kwargs).state_dict(), ckpt)
    config = tmp_path / 'other.py'
    config.write_text(f'model = dict(backbone=dict(type="FLattenPVT", arch="tiny", **{kwargs!r}))')
    with pytest.raises(SystemExit, match=re.escape(f'no layer with focused linear attention '
                                                   f'(its linear layers: {listed})')):
        tool.main([str(config), ckpt, image, '--out', str(tmp_path / 'a.png')])


def test_flatten_deit_class_token_is_a_key(tmp_path):
    """FLatten-DeiT: queries are patch tokens after the class token; the maps
    hold their weights on the patch tokens and prefix_weight the class
    token's, the rows summing to 1 over both (as the explicit formula)."""
    ckpt = str(tmp_path / 'deit.pth')
    write_official_checkpoint(ckpt, 'flatten_deit_tiny')
    from PIL import Image
    Image.fromarray((np.random.default_rng(1).random((50, 70, 3)) * 255).astype(np.uint8)) \
        .save(tmp_path / 'img.png')
    out = str(tmp_path / 'deit.png')
    tool.main(['flatten_deit_tiny', ckpt, str(tmp_path / 'img.png'), '--layer', 'blocks.3.attn',
               '--size', '50', '70', '--points', '0.5,0.5', '1,1', '--out', out])
    drawn = np.load(str(tmp_path / 'deit.npz'))
    assert tuple(drawn['query_grid']) == (4, 5) and tuple(drawn['grid']) == (4, 5)
    assert drawn['queries'].tolist() == [1 + 2 * 5 + 2, 1 + 19]
    assert drawn['focused'].shape == (2, 3, 1 + 20)
    totals = drawn['focused_map'].reshape(2, -1).sum(-1) + drawn['prefix_weight'][0]
    np.testing.assert_allclose(totals, 1, rtol=1e-4)
    assert (drawn['prefix_weight'] > 0).all()

    from flatten_mm import FLattenDeiT
    model = FLattenDeiT(arch='tiny', init_cfg=dict(type='Pretrained', checkpoint=ckpt))
    model.init_weights()
    layer = model.eval().blocks[3].attn
    caught = {}
    layer.register_forward_pre_hook(lambda m, a: caught.update(x=a[0]))
    with torch.no_grad():
        model(tool.load_image(str(tmp_path / 'img.png'), (50, 70))[1])
        x = caught['x']
        C, h = layer.embed_dims, layer.num_heads
        q = layer.q(x)[0]
        k = F.linear(x, layer.kv.weight[:C], layer.kv.bias[:C])[0]
        k = torch.cat([k[:1], k[1:] + layer.positional_encoding_for((4, 5))[0]])
        s = F.softplus(layer.scale).view(-1)

        def phi(t):
            a = (F.relu(t) + 1e-6) / s
            ap = a ** layer.focusing_factor
            return ap / ap.norm(dim=-1, keepdim=True) * a.norm(dim=-1, keepdim=True)
        qs = torch.as_tensor(drawn['queries'])
        scores = torch.einsum('phd,nhd->phn', phi(q[qs]).view(2, h, -1), phi(k).view(-1, h, 64))
        rows = (scores / scores.sum(-1, keepdim=True)).mean(1)
    np.testing.assert_allclose(drawn['focused_map'].reshape(2, -1), rows[:, 1:].numpy(),
                               rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(drawn['prefix_weight'][0], rows[:, 0].numpy(), rtol=1e-3)
