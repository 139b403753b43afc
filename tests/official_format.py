"""Writes checkpoints laid out as the FLatten release's (``{'model': sd}``,
official names, Swin's fused ``qkv`` and stored ``attn_mask`` buffers, CSwin's
block-level ``qkv`` and ``proj`` in linear blocks,
optionally a pickled yacs config and optimizer state)."""
import sys
import types

import timm
import torch


def official_state_dict(model) -> dict:
    """The release's state dict for one of our timm classifiers."""
    sd = {}
    for key, value in model.state_dict().items():
        sd[key] = value.clone()
    if any('layers.' in k for k in sd):  # Swin: fuse q / kv, add shift masks
        for key in [k for k in sd if k.endswith('attn.q.weight') or k.endswith('attn.q.bias')]:
            prefix, kind = key.rsplit('.q.', 1)
            sd[f'{prefix}.qkv.{kind}'] = torch.cat([sd.pop(key), sd.pop(f'{prefix}.kv.{kind}')])
        for key in [k for k in sd if k.endswith('attn.relative_position_index')]:
            block = key.rsplit('.attn.', 1)[0]
            if int(block.rsplit('.', 1)[1]) % 2 == 1:
                sd[f'{block}.attn_mask'] = torch.zeros(4, 49, 49)
    if 'stage1_conv_embed.0.weight' in sd:  # CSwin: linear blocks keep qkv, proj outside
        for key in [k for k in sd if '.attns.0.q.' in k]:
            block, kind = key.split('.attns.0.q.')
            sd[f'{block}.qkv.{kind}'] = torch.cat([sd.pop(key),
                                                    sd.pop(f'{block}.attns.0.kv.{kind}')])
            sd[f'{block}.proj.{kind}'] = sd.pop(f'{block}.attns.0.proj.{kind}')
    return sd


def randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'scale' in name or 'positional_encoding' in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def write_official_checkpoint(path, variant, seed=0, with_config=False):
    """Random weights for ``variant`` in the release's format; returns the
    model that holds the same weights."""
    model = randomize(timm.create_model(variant), seed).eval()
    ckpt = {'model': official_state_dict(model)}
    if with_config:
        ckpt['optimizer'] = {'state': {}, 'param_groups': [{'lr': 1e-3, 'params': [0]}]}
        ckpt['epoch'] = 299
        ckpt['config'] = make_yacs_like_config()
    torch.save(ckpt, path)
    sys.modules.pop('yacs.config', None)
    sys.modules.pop('yacs', None)
    return model


def make_yacs_like_config():
    """An object pickled as ``yacs.config.CfgNode`` (as the release stores its
    config), without needing yacs: a stand-in module exists only while saving."""
    yacs = types.ModuleType('yacs')
    config = types.ModuleType('yacs.config')

    class CfgNode(dict):
        pass
    CfgNode.__module__ = 'yacs.config'
    CfgNode.__qualname__ = 'CfgNode'
    config.CfgNode = CfgNode
    yacs.config = config
    sys.modules['yacs'] = yacs
    sys.modules['yacs.config'] = config
    cfg = CfgNode(MODEL=CfgNode(TYPE='flatten_pvt'), TRAIN=CfgNode(EPOCHS=300))
    return cfg
