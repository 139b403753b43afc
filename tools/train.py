"""Train a detector, segmenter or ImageNet classifier from an mmdet / mmseg /
mmpretrain config.

One script for all: the config's ``default_scope`` (``mmdet``, ``mmseg`` or
``mmpretrain``, set by the upstream base configs) decides which library builds
the model.

    python tools/train.py CONFIG [--work-dir DIR] [--resume [CKPT]] [--amp]
                          [--cfg-options k=v ...] [--launcher none|pytorch|slurm|mpi]
"""
import argparse

from mmengine.runner import Runner

from flatten_mm.engine import add_hooks

from common import add_common_args, end_distributed, load_config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description='Train a model with a FLatten backbone')
    parser.add_argument('config', help='config file path')
    parser.add_argument('--resume', nargs='?', type=str, const='auto',
                        help='resume from CKPT, or from the latest checkpoint in '
                        'the work dir when no path is given')
    parser.add_argument('--amp', action='store_true',
                        help='automatic mixed precision (needs a GPU)')
    add_common_args(parser)
    return parser.parse_args(argv)


def build_config(args):
    cfg = load_config(args)
    if args.amp:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit('--amp needs a GPU: mmengine\'s AmpOptimWrapper does not '
                             'run on the CPU (train in fp32 there).')
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    # random state in checkpoints, so --resume continues as if never stopped;
    # a clear error for an empty dataset; an optimizer step compile=True leaves eager
    add_hooks(cfg, 'RandomStateHook', 'EmptyDatasetHook', 'EagerOptimizerStepHook')
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
    finished = False
    try:
        runner.train()
        finished = True
    finally:
        end_distributed(finished)


if __name__ == '__main__':
    main()
