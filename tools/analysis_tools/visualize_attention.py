"""Draw the focused linear attention of one layer as heat maps over an image.

    python tools/analysis_tools/visualize_attention.py MODEL CHECKPOINT IMAGE
        [--layer NAME] [--points X,Y ...] [--size H W] [--out attention.png]

MODEL is a config file (its ``model.backbone`` is used), a timm name
(``flatten_pvt_tiny``) or ``Backbone:arch`` (``FLattenSwin:tiny``). CHECKPOINT
is an official ImageNet file or one written by mmengine (its ``backbone.``
weights are used). Query points are fractions of the width and height.

For each query, a row shows the image with the query marked, the focused
linear attention weights ``phi(q).phi(k_j) / sum_j phi(q).phi(k_j)`` (mean over
heads) and, for comparison, ``softmax(q.k_j / sqrt(d))`` on the same layer's q
and k. Keys of a spatially reduced layer lie on a coarser grid; the maps are
drawn on that grid, stretched to the image. The arrays drawn are saved next to
the PNG (``.npz``). ``--list-layers`` prints the layers to choose from.
In a layer with a class token (FLatten-DeiT) the queries are patch tokens, the
maps show the weights on the patch tokens, and the weight each query gives the
class token is saved as ``prefix_weight`` (its focused and softmax values).
"""
import argparse
import os
import os.path as osp
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flatten_mm.models import backbones  # noqa: E402
from flatten_mm.analysis import attention_weights  # noqa: E402
from flatten_mm.models.attention import FocusedLinearAttention  # noqa: E402

MEAN = np.array([123.675, 116.28, 103.53], dtype=np.float32)
STD = np.array([58.395, 57.12, 57.375], dtype=np.float32)
TIMM_KINDS = {'pvt': 'FLattenPVT', 'pvtv2': 'FLattenPVTv2', 'swin': 'FLattenSwin',
              'cswin': 'FLattenCSwin', 'deit': 'FLattenDeiT'}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('model', help='config file, timm name or Backbone:arch')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('image', help='image file')
    parser.add_argument('--layer', help='focused attention layer (default: the first); '
                        'see --list-layers')
    parser.add_argument('--points', nargs='+', default=['0.3,0.3', '0.5,0.5', '0.7,0.7'],
                        help='query points X,Y as fractions of width and height')
    parser.add_argument('--size', type=int, nargs=2, default=(224, 224), metavar=('H', 'W'),
                        help='resize the image to H x W first')
    parser.add_argument('--out', default='attention.png', help='output PNG')
    parser.add_argument('--list-layers', action='store_true', help='print the layers and stop')
    return parser.parse_args(argv)


def backbone_spec(model: str):
    """(class, kwargs) of the backbone MODEL names."""
    if model.endswith('.py'):
        from mmengine.config import Config
        cfg = Config.fromfile(model).model
        kwargs = dict(cfg.get('backbone', cfg))
        name = kwargs.pop('type', None)
        kwargs.pop('init_cfg', None)
        kwargs.pop('_delete_', None)
    elif ':' in model:
        name, arch = model.split(':', 1)
        kwargs = dict(arch=arch)
    else:
        from flatten_mm.registry import TIMM_MODELS
        if model not in TIMM_MODELS:
            raise SystemExit(f'unknown model {model!r}: give a config file, Backbone:arch '
                             f'or one of {sorted(TIMM_MODELS)}')
        kind, arch, extra = TIMM_MODELS[model]
        name, kwargs = TIMM_KINDS[kind], dict(arch=arch, **extra)
    cls = getattr(backbones, str(name), None)
    if not isinstance(cls, type):
        raise SystemExit(f'{model}: backbone type {name!r} is not a FLatten backbone; '
                         f'choose from {sorted(TIMM_KINDS.values())}')
    return cls, kwargs


def build_backbone(model: str, checkpoint: str) -> torch.nn.Module:
    cls, kwargs = backbone_spec(model)
    backbone = cls(**kwargs, init_cfg=dict(type='Pretrained', checkpoint=checkpoint))
    backbone.init_weights()
    return backbone.eval()


def focused_layers(backbone: torch.nn.Module) -> dict:
    """The backbone's linear attention layers with the focused design (the
    weights the tool draws); SystemExit naming the designs when it has none."""
    linear = {name: m for name, m in backbone.named_modules()
              if isinstance(m, FocusedLinearAttention)}
    layers = {name: m for name, m in linear.items() if m.attn_design == 'focused'}
    if not layers:
        designs = sorted({m.attn_design for m in linear.values()})
        raise SystemExit('the model has no layer with focused linear attention (its linear '
                         f'layers: {designs or "none"}); the tool draws the focused '
                         "design's weights, of attn_design='focused' in an L stage")
    return layers


def load_image(path: str, size) -> tuple:
    from PIL import Image
    if not osp.isfile(path):
        raise SystemExit(f'image not found: {path}')
    img = np.asarray(Image.open(path).convert('RGB').resize(size[::-1], Image.BILINEAR))
    x = torch.from_numpy((img.astype(np.float32) - MEAN) / STD).permute(2, 0, 1)[None]
    return img, x


def parse_points(points) -> list:
    out = []
    for p in points:
        try:
            x, y = (float(v) for v in p.split(','))
        except ValueError:
            raise SystemExit(f'bad point {p!r}: give X,Y, e.g. 0.5,0.25') from None
        if not (0 <= x <= 1 and 0 <= y <= 1):
            raise SystemExit(f'point {p!r} lies outside the image: X and Y must be in [0, 1]')
        out.append((x, y))
    return out


def attention_maps(backbone, layer: str, image: torch.Tensor, points) -> dict:
    """Run the backbone, catch the layer's input, and compute the rows of the
    queries nearest to ``points`` (fractions of width, height)."""
    layers = focused_layers(backbone)
    if layer not in layers:
        raise SystemExit(f'no focused attention layer {layer!r}; choose from {list(layers)}')
    caught = {}

    def catch(module, args):
        caught.setdefault('x', args[0])
        caught.setdefault('hw', tuple(args[1]))
    handle = layers[layer].register_forward_pre_hook(catch)
    with torch.no_grad():
        backbone(image)
    handle.remove()
    x, (H, W) = caught['x'], caught['hw']
    if x.shape[0] != 1:
        raise SystemExit(f'layer {layer} attends within windows ({x.shape[0]} of them); '
                         'choose a layer with global attention')
    P = layers[layer].num_prefix_tokens  # a class token before the grid's tokens
    queries = torch.tensor([P + min(int(y * H), H - 1) * W + min(int(px * W), W - 1)
                            for px, y in points])
    focused, softmax, grid = attention_weights(layers[layer], x, (H, W), queries)
    return dict(focused=focused.numpy(), softmax=softmax.numpy(), grid=np.array(grid),
                queries=queries.numpy(), query_grid=np.array((H, W)),
                focused_map=focused[..., P:].mean(1).reshape(len(points), *grid).numpy(),
                softmax_map=softmax[..., P:].mean(1).reshape(len(points), *grid).numpy(),
                prefix_weight=np.stack([focused[..., :P].sum(-1).mean(1).numpy(),
                                        softmax[..., :P].sum(-1).mean(1).numpy()]))


def draw(img: np.ndarray, maps: dict, points, out: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    P = len(points)
    fig, axes = plt.subplots(P, 3, figsize=(9, 3 * P), squeeze=False)
    h, w = img.shape[:2]
    for i, (px, py) in enumerate(points):
        panels = [(None, 'query'), (maps['focused_map'][i], 'focused linear attention'),
                  (maps['softmax_map'][i], 'softmax, same q and k')]
        for ax, (heat, title) in zip(axes[i], panels):
            ax.imshow(img)
            if heat is not None:
                ax.imshow(heat, cmap='jet', alpha=0.55, extent=(0, w, h, 0),
                          interpolation='nearest')
            ax.plot(px * w, py * h, marker='*', color='white', markersize=14,
                    markeredgecolor='black')
            ax.set_title(title, fontsize=9)
            ax.axis('off')
    fig.tight_layout()
    os.makedirs(osp.dirname(osp.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    with torch.no_grad():  # not set_grad_enabled(False): a caller's process keeps its mode
        run(args)


def run(args) -> None:
    """Draw and save the maps that ``args`` ask for."""
    backbone = build_backbone(args.model, args.checkpoint)
    layers = list(focused_layers(backbone))
    if args.list_layers:
        print('\n'.join(layers))
        return
    layer = args.layer or layers[0]
    points = parse_points(args.points)
    img, x = load_image(args.image, args.size)
    maps = attention_maps(backbone, layer, x, points)
    draw(img, maps, points, args.out)
    np.savez(osp.splitext(args.out)[0] + '.npz', layer=layer, **maps)
    print(f'layer {layer}: {len(points)} queries on a {tuple(maps["query_grid"])} grid, '
          f'keys on {tuple(maps["grid"])}; wrote {args.out}')


if __name__ == '__main__':
    main()
