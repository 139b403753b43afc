"""Running the tools as a user would (subprocesses), on the tiny shapes data."""
import os
import os.path as osp
import re
import subprocess
import sys
from typing import Mapping, Optional

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def worker_threads(environ: Mapping[str, str], cpus: Optional[int] = None) -> Optional[int]:
    """Torch threads for one pytest-xdist worker: the cores this process may
    use, shared among the workers (at least 1), or a smaller OMP_NUM_THREADS
    already set; None outside xdist."""
    workers = environ.get('PYTEST_XDIST_WORKER_COUNT')
    if not workers:
        return None
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    share = max(1, cpus // int(workers))
    preset = environ.get('OMP_NUM_THREADS', '')
    return min(share, int(preset)) if preset.isdigit() and int(preset) > 0 else share


def run(*args, cwd, env=None, python=True):
    """Run a script with this Python (or a command, ``python=False``); fail
    the test with the output's end unless it exits 0. Returns the output."""
    env = dict(os.environ, PYTHONWARNINGS='ignore', **(env or {}))
    cmd = [sys.executable, *args] if python else list(args)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(log: str):
    return [float(x) for x in re.findall(r'Iter\(train\).*? loss: ([0-9.]+)', log)]


def det_options(shapes, iters):
    return ['--cfg-options', f'train_cfg.max_iters={iters}', f'train_cfg.val_interval={iters}',
            f'train_dataloader.dataset.data_root={shapes}/',
            f'val_dataloader.dataset.data_root={shapes}/',
            f'test_dataloader.dataset.data_root={shapes}/',
            f'val_evaluator.ann_file={shapes}/annotations/instances_val.json',
            f'test_evaluator.ann_file={shapes}/annotations/instances_val.json',
            'train_dataloader.batch_size=4', 'train_dataloader.num_workers=0',
            'train_dataloader.persistent_workers=False', 'val_dataloader.num_workers=0',
            'val_dataloader.persistent_workers=False', 'test_dataloader.num_workers=0',
            'test_dataloader.persistent_workers=False', 'default_hooks.logger.interval=1']


def seg_options(shapes, iters):
    return ['--cfg-options', f'train_cfg.max_iters={iters}', f'train_cfg.val_interval={iters}',
            f'train_dataloader.dataset.data_root={shapes}/ade/',
            f'val_dataloader.dataset.data_root={shapes}/ade/',
            f'test_dataloader.dataset.data_root={shapes}/ade/',
            'model.data_preprocessor.size=[64,64]',
            'train_dataloader.batch_size=4', 'train_dataloader.num_workers=0',
            'train_dataloader.persistent_workers=False', 'val_dataloader.num_workers=0',
            'val_dataloader.persistent_workers=False', 'test_dataloader.num_workers=0',
            'test_dataloader.persistent_workers=False', 'default_hooks.logger.interval=1']


def heavy_first(items: list) -> None:
    """Tests marked ``heavy(SECONDS)`` first, the longest first, in place; the
    rest after them in their own order. pytest-xdist's ``worksteal`` hands each
    worker a share of this order, and a worker that runs out takes the other's
    last ones: so the workers end together, not one of them alone in a long
    test at the end."""
    def seconds(item) -> float:
        mark = item.get_closest_marker('heavy')
        if mark is None:
            return 0
        if len(mark.args) != 1:
            raise ValueError(f'{item.nodeid}: heavy takes the seconds the test takes, as '
                             f'@pytest.mark.heavy(30), got {mark.args}')
        return mark.args[0]
    items.sort(key=lambda item: -seconds(item))
