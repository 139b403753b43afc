"""mmdet's and mmseg's backbone test patterns, for every family: frozen
stages stay in eval mode and get no gradient, norm_eval, with_cp gives the
same outputs and gradients, out_indices, init_cfg errors, odd input sizes."""
import pytest
import torch
from torch import nn

from flatten_mm.models.ops import use_backend

from backbone_checks import FAMILIES, small_backbone

STRIDES = (4, 8, 16, 32)
DIMS = dict(pvt=[16, 32, 48, 64], pvtv2=[16, 32, 48, 64], swin=[16, 32, 64, 128],
            cswin=[16, 32, 64, 128])


def frozen_modules(model, k):
    modules = list(model.stem_modules())
    for i in range(k):
        modules += model.stages[i].parts(model)
    return modules


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('frozen', [0, 2, 4])
def test_frozen_stages_stay_eval_and_frozen(family, frozen):
    m = small_backbone(family, frozen_stages=frozen, drop_path_rate=0.)
    for _ in range(2):  # train() again does not unfreeze
        m.train()
        frozen_params = set()
        for mod in frozen_modules(m, frozen):
            params = [mod] if isinstance(mod, nn.Parameter) else list(mod.parameters())
            frozen_params.update(id(p) for p in params)
            if not isinstance(mod, nn.Parameter):
                assert all(not sub.training for sub in mod.modules())
        assert frozen_params or frozen == 0 and not m.stem_modules()
        for name, p in m.named_parameters():
            assert p.requires_grad == (id(p) not in frozen_params), name
    if frozen < 4:
        outs = m(torch.randn(1, 3, 40, 56))
        sum(o.square().mean() for o in outs).backward()
        for name, p in m.named_parameters():
            assert (p.grad is None) == (id(p) in frozen_params), name


@pytest.mark.parametrize('family', FAMILIES)
def test_norm_eval(family):
    m = small_backbone(family, norm_eval=True)
    m.train()
    norms = [mod for mod in m.modules() if isinstance(mod, nn.LayerNorm)]
    assert norms and not any(n.training for n in norms)
    assert m.training and all(mod.training for mod in m.modules()
                              if isinstance(mod, (nn.Linear, nn.Conv2d)))
    m.eval()
    m.train()
    assert not any(n.training for n in norms)
    assert all(n.training for n in small_backbone(family).train().modules()
               if isinstance(n, nn.LayerNorm))


@pytest.mark.parametrize('family', FAMILIES)
def test_with_cp_same_outputs_and_gradients(family):
    a = small_backbone(family, drop_path_rate=0.)
    b = small_backbone(family, drop_path_rate=0., with_cp=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 37, 45)
    outs = []
    for m in (a.train(), b.train()):
        o = m(x)
        sum(t.square().sum() for t in o).backward()
        outs.append(o)
    for oa, ob in zip(*outs, strict=True):
        torch.testing.assert_close(oa, ob)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize('family', (*FAMILIES, 'deit'))
def test_with_cp_recomputes_on_the_backend_of_the_forward(family):
    """The forward on another attention backend than the one ``'auto'``
    takes (``use_backend`` around the forward only, as comparisons and
    benchmarks set it), the backward after: checkpointing recomputes each block
    on the forward's backend (on ``'auto'``'s, whose ops save other tensors,
    torch raised ``CheckpointError``), at each backward, and the gradients are
    those without checkpointing."""
    a = small_backbone(family, drop_path_rate=0.)
    b = small_backbone(family, drop_path_rate=0., with_cp=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 37, 45)
    for m in (a.train(), b.train()):
        with use_backend('reference'):
            loss = sum(t.square().sum() for t in m(x))
        loss.backward(retain_graph=True)
        loss.backward()  # a second backward recomputes the blocks again
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('out_indices', [(0,), (1,), (2,), (3,), (0, 2), (1, 2, 3), [0, 1, 2, 3]])
def test_out_indices(family, out_indices):
    m = small_backbone(family, out_indices=out_indices).eval()
    with torch.no_grad():
        outs = m(torch.randn(1, 3, 64, 64))
    assert len(outs) == len(out_indices)
    for o, i in zip(outs, out_indices):
        assert tuple(o.shape) == (1, DIMS[family][i], 64 // STRIDES[i], 64 // STRIDES[i])


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('hw', [(31, 31), (1, 1), (33, 7), (67, 45)])
def test_odd_sizes(family, hw):
    m = small_backbone(family).eval()
    with torch.no_grad():
        outs = m(torch.randn(1, 3, *hw))
    for o, s, c in zip(outs, STRIDES, DIMS[family], strict=True):
        assert tuple(o.shape) == (1, c, -(-hw[0] // s), -(-hw[1] // s))
        assert torch.isfinite(o).all()


@pytest.mark.parametrize('family', FAMILIES)
def test_init_cfg_errors(family):
    with pytest.raises(ValueError, match="init_cfg of type 'Pretrained' needs a 'checkpoint'"):
        small_backbone(family, init_cfg=dict(type='Pretrained'))
    with pytest.raises(ValueError, match='init_cfg must be None, a dict or a list of dicts, '
                                         'got 123'):
        small_backbone(family, init_cfg=123)
    with pytest.raises(FileNotFoundError, match='/no/such/flatten.pth'):
        small_backbone(family, init_cfg=dict(type='Pretrained', checkpoint='/no/such/flatten.pth'))
    # mmengine's initialisers on top of the release's initialisation
    m = small_backbone(family, init_cfg=dict(type='Constant', layer='LayerNorm', val=2.0))
    assert all(torch.all(mod.weight == 2) for mod in m.modules() if isinstance(mod, nn.LayerNorm))


@pytest.mark.parametrize('family', FAMILIES)
def test_pretrained_in_an_init_cfg_list_and_with_a_prefix(family, tmp_path):
    """mmengine's forms of init_cfg: a list (Pretrained applied after the other
    initialisers, as mmengine orders them) and Pretrained's ``prefix`` (keys of
    one model in a file of several). A list once went to mmengine's own
    Pretrained, which loaded nothing from a release file but a warning."""
    source = small_backbone(family)
    sd = source.state_dict()
    release = tmp_path / 'release.pth'
    torch.save({'model': sd}, release)
    both = tmp_path / 'teacher_student.pth'
    torch.save({'state_dict': {**{f'teacher.backbone.{k}': v for k, v in sd.items()},
                               **{f'student.backbone.{k}': v * 0 for k, v in sd.items()}}}, both)
    constant = dict(type='Constant', layer='LayerNorm', val=2.0)
    for init_cfg in ([constant, dict(type='Pretrained', checkpoint=str(release))],
                     dict(type='Pretrained', checkpoint=str(both), prefix='teacher.backbone.'),
                     dict(type='Pretrained', checkpoint=str(both), prefix='teacher.backbone')):
        m = small_backbone(family, init_cfg=init_cfg)
        for name, value in m.state_dict().items():
            torch.testing.assert_close(value, sd[name], rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="no tensors under the prefix 'pupil.'"):
        small_backbone(family, init_cfg=dict(type='Pretrained', checkpoint=str(both),
                                             prefix='pupil.'))
    with pytest.raises(ValueError, match='2 Pretrained entries'):
        small_backbone(family, init_cfg=[dict(type='Pretrained', checkpoint=str(release))] * 2)


@pytest.mark.parametrize('family', FAMILIES)
def test_detector_backbone_loads_with_fewer_outputs(family, tmp_path):
    """A trained detector's backbone (four outputs, with Swin's and CSwin's output
    norms) as the Pretrained weights of one with fewer outputs, as mmdet's Swin
    allows: the surplus output norms are left out, everything else loads."""
    source = small_backbone(family)
    path = tmp_path / 'detector.pth'
    torch.save({'state_dict': {f'backbone.{k}': v for k, v in source.state_dict().items()}},
               path)
    m = small_backbone(family, out_indices=(3,),
                       init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    for name, value in m.state_dict().items():
        torch.testing.assert_close(value, source.state_dict()[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize('family', FAMILIES + ('deit', ))
def test_pretrained_rgb_weights_fit_other_image_channels(family, tmp_path):
    """Weights learnt on RGB images load into a backbone for 1 or 6 image
    channels (grey images, stereo pairs), as timm's loader fits them: a grey
    image gives what the RGB model gives for it in all three channels, and
    an image of two stacked copies of an RGB one what the RGB model gives for
    that one. Every other weight loads unchanged. (Before: an error, as for a
    checkpoint of another architecture.)"""
    source = small_backbone(family, drop_path_rate=0.).eval()
    path = tmp_path / 'rgb.pth'
    torch.save({'model': source.state_dict()}, path)
    rgb = torch.randn(2, 3, 37, 45)
    for channels, images, same in ((1, rgb[:, :1], rgb[:, :1].expand(-1, 3, -1, -1)),
                                   (6, torch.cat([rgb, rgb], 1), rgb)):
        m = small_backbone(family, in_channels=channels, drop_path_rate=0.,
                           init_cfg=dict(type='Pretrained', checkpoint=str(path))).eval()
        first = f'{m.first_conv}.weight'
        assert m.state_dict()[first].shape[1] == channels
        for name, value in m.state_dict().items():
            if name != first:
                torch.testing.assert_close(value, source.state_dict()[name], rtol=0, atol=0,
                                           msg=name)
        with torch.no_grad():
            for got, want in zip(m(images), source(same), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('family', FAMILIES + ('deit', ))
def test_frozen_stages_are_deterministic_with_dropout(family):
    """With drop_rate > 0 a frozen stage's output is the same in every training
    step, as in mmdet's Swin (the dropout after the position embedding, in the
    stem or in PVT's stages, once stayed in training mode)."""
    first = dict(out_indices=(0, 3)) if family == 'deit' else {}  # the first stage's output
    m = small_backbone(family, frozen_stages=1, drop_rate=0.5, drop_path_rate=0., **first).train()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(m(x)[0], m(x)[0], rtol=0, atol=0)
