"""What tools/train.py and tools/test.py share: the usual OpenMMLab flags and
turning them into a config."""
import argparse
import os
import os.path as osp

from mmengine.config import Config, DictAction


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--work-dir', help='directory for logs, checkpoints, results')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config entries, e.g. train_cfg.max_iters=100')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)


def read_config(path: str) -> Config:
    """``Config.fromfile(path)``, with a clear error where mmengine cannot look up
    the packages of ``mmdet::`` / ``mmseg::`` bases: it does so through
    ``pkg_resources``, which setuptools 82 removed (and torch asks for a
    setuptools of 77 or later, so pip may install the newest)."""
    try:
        return Config.fromfile(path)
    except ModuleNotFoundError as err:
        if err.name != 'pkg_resources':
            raise
        raise ModuleNotFoundError(
            f'{path} inherits an installed package\'s configs, which mmengine looks '
            f'up through pkg_resources, and setuptools {setuptools_version()} has none '
            f'(setuptools 82 removed it): pip install "setuptools<82"',
            name='pkg_resources') from err


def setuptools_version() -> str:
    """The installed setuptools' version, or 'not installed'."""
    from importlib import metadata
    try:
        return metadata.version('setuptools')
    except metadata.PackageNotFoundError:
        return 'not installed'


def load_config(args) -> Config:
    """Read ``args.config`` with flatten_mm imported, apply --cfg-options,
    --launcher and --work-dir (default ``work_dirs/<config name>``); without a
    GPU, set distributed runs up for gloo."""
    import flatten_mm  # registers the backbones; fixes checkpoint loading
    os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    cfg = read_config(args.config)
    cfg.launcher = args.launcher
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    if args.work_dir:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])
    flatten_mm.setup_distributed(cfg)  # gloo and CPU DDP when there is no GPU
    return cfg


def end_distributed(finished: bool = False) -> None:
    """Destroy the process group a distributed launch made, if any, before the
    interpreter exits: left to interpreter teardown, gloo's worker threads can
    abort the process ("terminate called without an active exception", exit
    code -6) after the run has finished and saved everything.

    ``finished``: the run ended normally on this rank, so every rank reaches
    this point; a barrier first lets no rank tear its connections down while
    another still completes the last collective (after a failure, a barrier
    could wait on a rank that never comes, so there is none)."""
    import torch
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        if finished:  # NCCL's barrier is told the device, or it guesses
            nccl = dist.get_backend() == 'nccl'
            dist.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)
        dist.destroy_process_group()
