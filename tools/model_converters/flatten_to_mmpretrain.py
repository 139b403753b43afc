"""Convert a FLatten classifier checkpoint (a released file, or one saved from
timm) into an mmpretrain ``ImageClassifier`` checkpoint for our ImageNet
configs, e.g. to fine-tune at 384 or evaluate with mmpretrain's tools:

    python tools/model_converters/flatten_to_mmpretrain.py flatten_swin_tiny \\
        checkpoints/flatten_swin_tiny.pth checkpoints/flatten-swin-t_in1k_mmpretrain.pth

The file is read through flatten_mm's safe loader into the timm classifier
(which splits fused projections and drops the release's unused tensors), then
renamed: ``backbone.*``, the final norm as the backbone's last output norm, and
``head.fc.*``. The other way needs no conversion: timm
(``pretrained_cfg_overlay=dict(file=...)``) and the dense backbones
(``init_cfg=dict(type='Pretrained', checkpoint=...)``) read mmpretrain files.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('model', help='timm name, e.g. flatten_pvt_tiny')
    parser.add_argument('src', help='released or timm checkpoint')
    parser.add_argument('dst', help='mmpretrain checkpoint to write')
    args = parser.parse_args(argv)
    import timm

    from flatten_mm.conversion import to_mmpretrain
    from flatten_mm.registry import TIMM_MODELS
    if args.model not in TIMM_MODELS:
        parser.error(f'unknown model {args.model!r}; choose from {sorted(TIMM_MODELS)}')
    model = timm.create_model(args.model, pretrained=True,
                              pretrained_cfg_overlay=dict(file=args.src, custom_load=True))
    state_dict = to_mmpretrain(model)
    torch.save(dict(state_dict=state_dict,
                    meta=dict(converted_from=str(args.src), timm_name=args.model)), args.dst)
    print(f'{args.src} -> {args.dst}: {len(state_dict)} tensors '
          f'({sum(v.numel() for v in state_dict.values()):,} values)')
    return state_dict


if __name__ == '__main__':
    main()
