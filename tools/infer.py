"""Run a trained detector or segmenter on images and draw its predictions.

    python tools/infer.py CONFIG CHECKPOINT IMAGE [IMAGE ...] [--out-dir DIR]
                          [--score-thr 0.3] [--device cpu]

Detection configs go through mmdet's DetInferencer, segmentation configs
through mmseg's MMSegInferencer; pictures land in OUT_DIR/vis/.
"""
import argparse
import os.path as osp

from common import read_config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Draw predictions on images')
    parser.add_argument('config')
    parser.add_argument('checkpoint')
    parser.add_argument('images', nargs='+', help='image files')
    parser.add_argument('--out-dir', default='outputs')
    parser.add_argument('--score-thr', type=float, default=0.3,
                        help='detection score threshold for drawing')
    parser.add_argument('--device', default='cpu')
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import flatten_mm  # noqa: F401
    for path in [args.config, args.checkpoint, *args.images]:
        if not osp.isfile(path):
            raise SystemExit(f'file not found: {path}')
    scope = read_config(args.config).get('default_scope')
    if scope == 'mmdet':
        from mmdet.apis import DetInferencer
        inferencer = DetInferencer(model=args.config, weights=args.checkpoint,
                                   device=args.device, show_progress=False)
        inferencer(args.images, out_dir=args.out_dir, pred_score_thr=args.score_thr,
                   no_save_pred=False)
    elif scope == 'mmseg':
        from mmseg.apis import MMSegInferencer
        inferencer = MMSegInferencer(model=args.config, weights=args.checkpoint,
                                     device=args.device)
        inferencer(args.images, out_dir=args.out_dir, show=False)
    else:
        raise SystemExit(f"{args.config}: default_scope is {scope!r}; expected 'mmdet' or 'mmseg'")
    print(f'predictions drawn in {osp.join(args.out_dir, "vis")}')


if __name__ == '__main__':
    main()
