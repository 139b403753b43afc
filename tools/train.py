"""Train a detector or segmenter from an mmdet / mmseg config.

One script for both: the config's ``default_scope`` (``mmdet`` or ``mmseg``,
set by the upstream base configs) decides which library builds the model.

    python tools/train.py CONFIG [--work-dir DIR] [--resume [CKPT]] [--amp]
                          [--cfg-options k=v ...] [--launcher none|pytorch|slurm|mpi]
"""
import argparse
import os
import os.path as osp

from mmengine.config import Config, DictAction
from mmengine.runner import Runner


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train a model with a FLatten backbone')
    parser.add_argument('config', help='config file path')
    parser.add_argument('--work-dir', help='directory for logs and checkpoints')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from CKPT, or from the latest checkpoint in '
                        'the work dir when no path is given')
    parser.add_argument('--amp', action='store_true',
                        help='automatic mixed precision (needs a GPU)')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config entries, e.g. train_cfg.max_iters=100')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    return args


def build_config(args) -> Config:
    import flatten_mm  # noqa: F401  (registers the backbones; fixes checkpoint loading)
    cfg = Config.fromfile(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    if args.amp:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit('--amp needs a GPU: mmengine\'s AmpOptimWrapper does not '
                             'run on the CPU (train in fp32 there).')
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    return cfg


def main(argv=None):
    args = parse_args(argv)
    runner = Runner.from_cfg(build_config(args))
    runner.train()


if __name__ == '__main__':
    main()
