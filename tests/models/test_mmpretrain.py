"""mmpretrain classifiers over our backbones: the ImageNet configs build and
train a step, and checkpoints convert both ways with the same logits."""
import glob
import importlib.util
import os.path as osp

import pytest
import timm
import torch
from mmengine.config import Config
from mmengine.optim import build_optim_wrapper
from mmengine.registry import init_default_scope

import flatten_mm
from flatten_mm import load_checkpoint_file

from official_format import write_official_checkpoint

pytest.importorskip('mmpretrain')
ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
IN1K = sorted(glob.glob(osp.join(ROOT, 'configs', '*', '*_in1k*.py')))
CONFIG_OF = {
    'flatten_pvt_tiny': ('flatten_pvt/flatten-pvt-t_8xb128_in1k.py', 'FLattenPVT', 'tiny'),
    'flatten_pvt_v2_b0': ('flatten_pvtv2/flatten-pvtv2-b0_8xb128_in1k.py', 'FLattenPVTv2', 'b0'),
    'flatten_swin_tiny': ('flatten_swin/flatten-swin-t_8xb128_in1k.py', 'FLattenSwin', 'tiny'),
    'flatten_cswin_tiny': ('flatten_cswin/flatten-cswin-t_8xb128_in1k.py', 'FLattenCSwin', 'tiny'),
    'flatten_deit_tiny': ('flatten_deit/flatten-deit-t_8xb128_in1k.py', 'FLattenDeiT', 'tiny'),
}


def build_classifier(path):
    from mmpretrain.registry import MODELS
    init_default_scope('mmpretrain')
    cfg = Config.fromfile(path)
    cfg.model.setdefault('data_preprocessor', cfg.data_preprocessor)  # as the Runner does
    return cfg, MODELS.build(cfg.model)


def test_every_family_and_size_has_an_imagenet_config():
    # configs/attention_designs holds one config per attention design of some of them
    names = {osp.basename(p) for p in IN1K if osp.basename(osp.dirname(p)) != 'attention_designs'}
    assert names == {
        *(f'flatten-pvt-{a}_8xb128_in1k.py' for a in 'tsml'),
        *(f'flatten-pvtv2-b{i}_8xb128_in1k.py' for i in range(6)),
        *(f'flatten-swin-{a}_8xb128_in1k.py' for a in 'tsb'), 'flatten-swin-b_8xb64_in1k-384px.py',
        *(f'flatten-cswin-{a}_8xb128_in1k.py' for a in 'tsb'),
        'flatten-cswin-b_8xb64_in1k-384px.py',
        *(f'flatten-deit-{a}_8xb128_in1k.py' for a in 'tsb')}


@pytest.mark.parametrize('path', IN1K, ids=lambda p: osp.basename(p))
def test_imagenet_config_builds_and_trains_a_step(path):
    """The model, its data preprocessor with Mixup/CutMix, and the optimizer
    with its no-decay groups; one training step at 64x64 (any size works)
    changes the weights and gives a finite loss."""
    cfg, model = build_classifier(path)
    assert cfg.default_scope == 'mmpretrain'
    assert type(model.backbone).__name__ == cfg.model.backbone.type
    optim_wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    no_decay = {id(p) for g in optim_wrapper.optimizer.param_groups
                if g['weight_decay'] == 0 for p in g['params']}
    for name, p in model.named_parameters():
        if name.endswith(('positional_encoding', 'scale')) or 'pos_embed' in name:
            assert id(p) in no_decay, name
    assert id(model.head.fc.weight) not in no_decay
    from mmpretrain.structures import DataSample
    data = dict(inputs=[torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8) for _ in range(2)],
                data_samples=[DataSample().set_gt_label(i) for i in (3, 7)])
    before = model.head.fc.weight.detach().clone()
    model.train()
    losses = model.train_step(data, optim_wrapper)
    assert torch.isfinite(losses['loss'])
    assert not torch.equal(before, model.head.fc.weight)


@pytest.mark.parametrize('name', sorted(CONFIG_OF))
def test_checkpoints_convert_both_ways_with_the_same_logits(tmp_path, name):
    """A released file -> mmpretrain (tools/model_converters) gives the
    mmpretrain classifier the timm classifier's logits; the mmpretrain file
    loads back into timm and into the dense backbone."""
    official = str(tmp_path / 'official.pth')
    source = write_official_checkpoint(official, name).eval()
    converted = str(tmp_path / 'mmpretrain.pth')
    spec = importlib.util.spec_from_file_location(
        'converter', osp.join(ROOT, 'tools/model_converters/flatten_to_mmpretrain.py'))
    converter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(converter)
    converter.main([name, official, converted])

    config, cls_name, arch = CONFIG_OF[name]
    _, classifier = build_classifier(osp.join(ROOT, 'configs', config))
    classifier.load_state_dict(load_checkpoint_file(converted)['state_dict'])  # strict
    classifier.eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        want = source(x)
        torch.testing.assert_close(classifier(x, mode='tensor'), want, rtol=1e-5, atol=1e-5)
        back = timm.create_model(name, pretrained=True,
                                 pretrained_cfg_overlay=dict(file=converted)).eval()
        torch.testing.assert_close(back(x), want, rtol=0, atol=0)

    dense = getattr(flatten_mm, cls_name)(
        arch=arch, init_cfg=dict(type='Pretrained', checkpoint=converted, prefix='backbone.'))
    dense.init_weights()
    for key, value in dense.state_dict().items():
        if f'backbone.{key}' in classifier.state_dict():
            torch.testing.assert_close(value, classifier.state_dict()[f'backbone.{key}'])
