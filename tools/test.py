"""Evaluate a checkpoint with an mmdet / mmseg / mmpretrain config.

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--show-dir DIR]
                         [--cfg-options k=v ...] [--launcher none|pytorch|slurm|mpi]
"""
import argparse
import os.path as osp

from mmengine.runner import Runner

from flatten_mm.engine import add_hooks

from common import add_common_args, end_distributed, load_config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Test a model with a FLatten backbone')
    parser.add_argument('config', help='config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--show-dir', help='write pictures of the predictions '
                        '(mmdet: WORK_DIR/TIMESTAMP/SHOW_DIR, mmseg: WORK_DIR/SHOW_DIR)')
    parser.add_argument('--metrics-out', help='also write the metrics to this JSON file')
    add_common_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    cfg = load_config(args)
    if not osp.isfile(args.checkpoint):
        raise SystemExit(f'checkpoint not found: {args.checkpoint}')
    cfg.load_from = args.checkpoint
    add_hooks(cfg, 'EmptyDatasetHook')
    if args.show_dir and cfg.get('default_scope') not in ('mmdet', 'mmseg'):
        raise SystemExit(f"--show-dir draws detections and segmentations; "
                         f"{args.config} is a {cfg.get('default_scope')} config")
    if args.show_dir:
        is_det = cfg.get('default_scope') == 'mmdet'
        if 'visualization' not in cfg.default_hooks:
            kind = 'Det' if is_det else 'Seg'
            cfg.default_hooks.visualization = dict(type=f'{kind}VisualizationHook')
        hook = cfg.default_hooks.visualization
        hook.draw = True
        hook.interval = 1
        if is_det:
            hook.test_out_dir = args.show_dir  # under WORK_DIR/TIMESTAMP/
        else:  # mmseg's hook draws through the visualizer's save_dir
            cfg.visualizer.save_dir = osp.join(cfg.work_dir, args.show_dir)
    runner = Runner.from_cfg(cfg)
    finished = False
    try:
        metrics = runner.test()
        finished = True
    finally:
        end_distributed(finished)
    if args.metrics_out:
        import json
        with open(args.metrics_out, 'w') as f:
            json.dump({k: float(v) for k, v in metrics.items()}, f, indent=1)
    return metrics


if __name__ == '__main__':
    main()
