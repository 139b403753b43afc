"""Evaluate a checkpoint with an mmdet / mmseg config.

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--show-dir DIR]
                         [--cfg-options k=v ...] [--launcher none|pytorch|slurm|mpi]
"""
import argparse
import os
import os.path as osp

from mmengine.config import Config, DictAction
from mmengine.runner import Runner


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Test a model with a FLatten backbone')
    parser.add_argument('config', help='config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--work-dir', help='directory for the evaluation logs')
    parser.add_argument('--show-dir', help='write pictures of the predictions '
                        '(mmdet: WORK_DIR/TIMESTAMP/SHOW_DIR, mmseg: WORK_DIR/SHOW_DIR)')
    parser.add_argument('--metrics-out', help='also write the metrics to this JSON file')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config entries')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    return args


def kind_of(cfg) -> str:
    return cfg.get('default_scope')


def main(argv=None):
    args = parse_args(argv)
    import flatten_mm  # noqa: F401
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    if not osp.isfile(args.checkpoint):
        raise SystemExit(f'checkpoint not found: {args.checkpoint}')
    cfg.load_from = args.checkpoint
    if args.show_dir:
        if 'visualization' not in cfg.default_hooks:
            kind = 'Det' if kind_of(cfg) == 'mmdet' else 'Seg'
            cfg.default_hooks.visualization = dict(type=f'{kind}VisualizationHook')
        hook = cfg.default_hooks.visualization
        hook.draw = True
        hook.interval = 1
        if kind_of(cfg) == 'mmdet':
            hook.test_out_dir = args.show_dir  # under WORK_DIR/TIMESTAMP/
        else:  # mmseg's hook draws through the visualizer's save_dir
            cfg.visualizer.save_dir = osp.join(cfg.work_dir, args.show_dir)
    runner = Runner.from_cfg(cfg)
    metrics = runner.test()
    if args.metrics_out:
        import json
        with open(args.metrics_out, 'w') as f:
            json.dump({k: float(v) for k, v in metrics.items()}, f, indent=1)
    return metrics


if __name__ == '__main__':
    main()
