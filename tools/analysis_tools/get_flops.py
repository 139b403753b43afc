"""FLOPs and parameters of a config's model, a bare backbone or a classifier.

    python tools/analysis_tools/get_flops.py CONFIG --shape 800 1280
    python tools/analysis_tools/get_flops.py --backbone FLattenPVT --arch tiny --shape 224
    python tools/analysis_tools/get_flops.py --backbone FLattenCSwin --attn-type SSSS --shape 224
    python tools/analysis_tools/get_flops.py --timm flatten_swin_tiny --shape 224
    python tools/analysis_tools/get_flops.py --timm flatten_deit_tiny --compare-softmax

Counting follows mmengine's ``FlopAnalyzer`` (as mmdet's get_flops.py): one
multiply-accumulate = one FLOP, element-wise work is not counted. The focused
linear attention's matmuls, the depth-wise conv and softmax attention
(``scaled_dot_product_attention``) are counted by the handles in
``flatten_mm.analysis``; the focused mapping's element-wise operations are
reported on their own line. Detectors are traced in ``mode='tensor'`` (RPN
proposals and RoI heads included, as in mmdet's tool).
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mmengine.analysis import parameter_count  # noqa: E402
from mmengine.config import DictAction  # noqa: E402

from flatten_mm.analysis import flop_analyzer, focusing_ops  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config', nargs='?', help='an mmdet / mmseg / mmpretrain config')
    parser.add_argument('--backbone', help='a flatten_mm backbone class, e.g. FLattenPVT')
    parser.add_argument('--arch', default='tiny', help='arch of --backbone')
    parser.add_argument('--attn-type', help='attn_type of --backbone, e.g. SSSS for its '
                        'softmax counterpart (default: the backbone\'s)')
    parser.add_argument('--timm', help='a timm model name, e.g. flatten_pvt_tiny')
    parser.add_argument('--shape', type=int, nargs='+', default=[224],
                        help='input H W (one number: square)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config entries (as tools/train.py)')
    parser.add_argument('--compare-softmax', action='store_true',
                        help='also count the same model with softmax attention in every '
                        'stage (attn_type all S: e.g. DeiT for FLatten-DeiT), side by side')
    parser.add_argument('--out', help='write the numbers as JSON here')
    args = parser.parse_args(argv)
    if sum(x is not None for x in (args.config, args.backbone, args.timm)) != 1:
        parser.error('give exactly one of CONFIG, --backbone or --timm')
    if args.attn_type and not args.backbone:
        parser.error('--attn-type goes with --backbone')
    if args.compare_softmax and args.config:
        parser.error('--compare-softmax goes with --backbone or --timm')
    if len(args.shape) not in (1, 2) or min(args.shape) < 1:
        parser.error(f'--shape takes H W or one size, got {args.shape}')
    args.shape = tuple(args.shape) * (3 - len(args.shape))
    return args


class _Traced(torch.nn.Module):
    """Wraps a model call so the analyzer can trace it with one tensor input."""

    def __init__(self, model, call):
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, x):
        return self.call(self.model, x)


def from_config(path, shape, cfg_options):
    from mmengine.config import Config
    import flatten_mm  # noqa: F401
    cfg = Config.fromfile(path)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return model_of_config(cfg, shape, path)


def model_of_config(cfg, shape, name='the config'):
    """The model of an mmdet / mmseg / mmpretrain config (in eval mode) and a
    call that runs it on one image tensor."""
    from mmengine.registry import DefaultScope, init_default_scope
    scope = cfg.get('default_scope')
    if scope not in ('mmdet', 'mmseg', 'mmpretrain'):
        raise SystemExit(f'{name}: default_scope must be mmdet, mmseg or mmpretrain, '
                         f'got {scope!r}')
    init_default_scope(scope)
    H, W = shape
    meta = dict(img_shape=(H, W), ori_shape=(H, W), pad_shape=(H, W),
                batch_input_shape=(H, W), scale_factor=(1.0, 1.0))
    with DefaultScope.overwrite_default_scope(scope):
        from mmengine.registry import MODELS
        model_cfg = cfg.model.copy()
        if scope == 'mmpretrain' and cfg.get('data_preprocessor'):
            model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)  # as the Runner
        model = MODELS.build(model_cfg).eval()
        if scope == 'mmpretrain':
            return model, lambda m, x: m(x, mode='tensor')
        if scope == 'mmdet':
            from mmdet.structures import DetDataSample
            sample = DetDataSample(metainfo=meta)
        else:
            from mmseg.structures import SegDataSample
            sample = SegDataSample(metainfo=meta)
    return model, lambda m, x: m(x, [sample], mode='tensor')


def build(args, attn_type=None):
    """The model and how to call it; ``attn_type`` overrides the one of
    ``--backbone`` / ``--timm``."""
    attn_type = attn_type or args.attn_type
    if args.config:
        return from_config(args.config, args.shape, args.cfg_options)
    if args.backbone:
        from flatten_mm.models import backbones
        cls = getattr(backbones, args.backbone, None)
        if cls is None or not isinstance(cls, type):
            names = [n for n in backbones.__all__ if n[0].isupper()]
            raise SystemExit(f'unknown --backbone {args.backbone!r}; choose from {names}')
        kwargs = dict(arch=args.arch)
        if attn_type:
            kwargs['attn_type'] = attn_type
        try:
            model = cls(**kwargs)
        except ValueError as err:
            raise SystemExit(f'--backbone {args.backbone}: {err}')
        return model.eval(), lambda m, x: m(x)
    import timm
    import flatten_mm  # noqa: F401  (registers the classifiers)
    kwargs = dict(attn_type=attn_type) if attn_type else {}
    return timm.create_model(args.timm, **kwargs).eval(), lambda m, x: m(x)


def count(model, call, shape):
    x = torch.rand(1, 3, *shape)
    wrapped = _Traced(model, call)
    with torch.no_grad():
        analyzer = flop_analyzer(wrapped, (x,))
        flops = analyzer.total()
        by_op = dict(analyzer.by_operator())
        focus = focusing_ops(model, lambda: call(model, x))
    return dict(shape=list(shape), flops=flops, flops_by_operator=by_op,
                focusing_elementwise_ops=focus, params=parameter_count(model)[''])


def main(argv=None):
    args = parse_args(argv)
    model, call = build(args)
    result = count(model, call, args.shape)
    name = args.config or args.backbone and \
        f"{args.backbone}({args.arch}{', ' + args.attn_type if args.attn_type else ''})" or args.timm
    print(f'model: {name}\ninput shape: 1x3x{args.shape[0]}x{args.shape[1]}')
    print(f"FLOPs: {result['flops'] / 1e9:.3f} G (multiply-accumulates)")
    for op, n in sorted(result['flops_by_operator'].items(), key=lambda kv: -kv[1]):
        print(f'  {op}: {n / 1e9:.3f} G')
    print(f"focused mapping, element-wise (not in FLOPs): "
          f"{result['focusing_elementwise_ops'] / 1e9:.3f} G ops")
    print(f"params: {result['params'] / 1e6:.2f} M")
    if args.compare_softmax:
        softmax_type = 'S' * len(model.attn_type)
        softmax = count(*build(args, softmax_type), args.shape)
        result['softmax'] = dict(attn_type=softmax_type, **softmax)
        print(f"\n{'':12}{'this model':>14}{'softmax':>14}  (attn_type {softmax_type})")
        print(f"{'params (M)':12}{result['params'] / 1e6:14.2f}{softmax['params'] / 1e6:14.2f}")
        print(f"{'FLOPs (G)':12}{result['flops'] / 1e9:14.3f}{softmax['flops'] / 1e9:14.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(model=name, **result), indent=1))
    return result


if __name__ == '__main__':
    main()
