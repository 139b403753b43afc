"""Training-loop pieces mmengine 0.10 lacks: random state in checkpoints, and
distributed training on CPUs.

:class:`RandomStateHook` stores the Python, numpy and torch random generators
in every checkpoint and puts them back on ``--resume``, so a run stopped and
resumed draws the same augmentations, RoI samples and drop-path masks as one
that never stopped. mmengine itself saves only the seed, and its resume replays
the data of the finished iterations through the pipeline, which draws from the
generators again. With data loaded in the main process (``num_workers=0``) the
hook skips those batches by their indices alone and restores the state saved
after the last finished iteration; with worker processes (which re-seed
themselves) the replayed data is already right and only the main process's
generators are restored.

:func:`setup_distributed` makes mmengine's launchers work on machines without
a GPU: mmengine's ``init_dist`` calls ``torch.cuda.set_device`` and its DDP
wrapper is given ``device_ids=[LOCAL_RANK]``, both invalid for a CPU model.
"""
import random
from typing import Optional

import numpy as np
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS

STATE_KEY = 'random_state'


def get_random_state() -> dict:
    """The state of Python's, numpy's and torch's global generators, in plain
    types a weights-only ``torch.load`` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = dict(python=random.getstate(),
                 numpy=(kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
                 torch=torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_random_state(state: dict) -> None:
    """Inverse of :func:`get_random_state`."""
    version, internal, gauss = state['python']
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state['numpy']
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


class _IndexSkipper:
    """Stands in for the train loop's data iterator while mmengine skips the
    finished iterations: each ``next`` advances the sampler by one batch
    without loading it; after ``n`` of them the real iterator is put back and
    the saved random state restored."""

    def __init__(self, loop, n: int, state: dict):
        self.loop, self.left, self.state = loop, n, state
        self.real = loop.dataloader_iterator
        self.batches = self.real._iterator  # torch's single-process iterator

    def __next__(self):
        try:
            self.batches._next_index()
        except StopIteration:
            # a finite sampler's epoch ended: mmengine's iterator starts the
            # next one (loading its first batch; the state is restored below)
            next(self.real)
            self.batches = self.real._iterator
        self.left -= 1
        if self.left == 0:
            self.loop.dataloader_iterator = self.real
            set_random_state(self.state)
        return None


@HOOKS.register_module()
class RandomStateHook(Hook):
    """Save the random generators with each checkpoint; restore them on resume.

    Add it with ``custom_hooks = [dict(type='RandomStateHook')]``;
    ``tools/train.py`` adds it to every config that lacks it.
    """
    priority = 'VERY_LOW'  # restore after the other hooks' before_train

    def __init__(self) -> None:
        self._resumed: Optional[dict] = None

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint[STATE_KEY] = get_random_state()

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        self._resumed = checkpoint.get(STATE_KEY)
        if self._resumed is None:
            print_log('the checkpoint holds no random state: the resumed run will '
                      'draw other random numbers than an uninterrupted one',
                      logger='current', level=30)

    def before_train(self, runner) -> None:
        state, self._resumed = self._resumed, None
        loop = runner.train_loop
        done = getattr(loop, 'iter', 0)
        if state is None or done == 0:
            return
        iterator = getattr(loop, 'dataloader_iterator', None)
        inner = getattr(iterator, '_iterator', None)
        if inner is not None and inner._num_workers == 0 and hasattr(inner, '_next_index'):
            loop.dataloader_iterator = _IndexSkipper(loop, done, state)
        else:
            set_random_state(state)


def _dataset_description(dataset) -> str:
    parts = [type(dataset).__name__]
    for attr in ('data_root', 'ann_file', 'data_prefix'):
        value = getattr(dataset, attr, None)
        if value:
            parts.append(f'{attr}={value!r}')
    return ', '.join(parts)


@HOOKS.register_module()
class EmptyDatasetHook(Hook):
    """Stop with a clear error when a dataset holds no samples.

    An empty training set would otherwise hang mmengine's InfiniteSampler
    forever, and an empty validation set ends in an error deep inside a
    metric. ``tools/train.py`` and ``tools/test.py`` add this hook.
    """
    priority = 'VERY_HIGH'

    @staticmethod
    def _check(loader, split: str) -> None:
        dataset = getattr(loader, 'dataset', None)
        if dataset is not None and len(dataset) == 0:
            raise ValueError(f'the {split} dataset holds no samples '
                             f'({_dataset_description(dataset)}): check the paths, '
                             'and that annotations exist and match the images')

    def before_train(self, runner) -> None:
        self._check(runner.train_dataloader, 'training')

    def before_val(self, runner) -> None:
        self._check(runner.val_dataloader, 'validation')

    def before_test(self, runner) -> None:
        self._check(runner.test_dataloader, 'test')


def _optim_wrappers(optim_wrapper) -> list:
    """The OptimWrappers in ``optim_wrapper`` (one, or the values of an
    OptimWrapperDict)."""
    if hasattr(optim_wrapper, 'optim_wrappers'):
        return list(optim_wrapper.optim_wrappers.values())
    return [optim_wrapper]


@HOOKS.register_module()
class PlainParamGroupsHook(Hook):
    """Make every optimizer's parameter groups plain dicts before training.

    With a ``paramwise_cfg`` (all our detection and segmentation configs), the
    registry that builds the optimizer turns its list of parameter groups into
    ``ConfigDict`` objects. ``torch.compile`` cannot trace ``optimizer.step``
    over such dict subclasses, so mmengine's ``compile=True``, which compiles
    the whole ``train_step``, stops at the first step with "'UserDefinedDictVariable'
    object has no attribute 'items'" (torch 2.14). A resumed run already has
    plain dicts (the optimizer's ``load_state_dict`` rebuilds its groups); the
    hook gives a fresh run the same. For a training script that has dynamo
    trace the step: with :class:`EagerOptimizerStepHook` (``tools/train.py``)
    the step runs eagerly and the groups' type does not matter.
    """
    priority = 'VERY_HIGH'

    def before_train(self, runner) -> None:
        for wrapper in _optim_wrappers(runner.optim_wrapper):
            optimizer = wrapper.optimizer
            optimizer.param_groups = [dict(group) for group in optimizer.param_groups]


@HOOKS.register_module()
class EagerOptimizerStepHook(Hook):
    """Run every optimizer wrapper's ``step`` outside ``torch.compile``.

    mmengine's ``compile=True`` compiles the whole ``train_step``, the
    optimizer's step included. Under a ``paramwise_cfg`` mmengine makes one
    parameter group per parameter, and dynamo compiles the step of each group
    on its own, guarded on that group's parameters: after eight groups it warns
    ``hit config.recompile_limit (8)`` in torch's optimizer and steps the others
    eagerly. With this hook the step (gradient clipping, loss scaling and the
    optimizer) is a graph break and runs eagerly for every group: the same
    results, without those compilations or the warning, and ``ConfigDict``
    groups (:class:`PlainParamGroupsHook`) are never traced. ``tools/train.py``
    adds it; with another training script add
    ``custom_hooks=[dict(type='EagerOptimizerStepHook')]``.
    """
    priority = 'VERY_HIGH'

    def before_train(self, runner) -> None:
        for wrapper in _optim_wrappers(runner.optim_wrapper):
            if not getattr(wrapper.step, '_eager_step', False):  # once (train() may run again)
                wrapper.step = torch._dynamo.disable(wrapper.step)  # (over a scheduler's)
                wrapper.step._eager_step = True


def patch_empty_dataset_error() -> bool:
    """Make mmengine datasets that find no samples say so.

    mmengine 0.10's ``BaseDataset.full_init`` serialises the sample list with
    ``np.concatenate``, which fails on an empty list with "need at least one
    array to concatenate". The patched step raises a ValueError naming the
    dataset and its paths instead. Returns False if already patched.
    """
    from mmengine.dataset import BaseDataset
    original = BaseDataset._serialize_data
    if getattr(original, '_flatten_mm', False):
        return False

    def _serialize_data(self):
        if len(self.data_list) == 0:
            raise ValueError(f'the dataset holds no samples ({_dataset_description(self)}): '
                             'check the paths, and that annotations exist and '
                             'match the images')
        return original(self)
    _serialize_data._flatten_mm = True
    BaseDataset._serialize_data = _serialize_data
    return True


def add_hooks(cfg: Config, *types: str) -> None:
    """Append hooks of ``types`` to ``cfg.custom_hooks`` unless already there."""
    hooks = list(cfg.get('custom_hooks') or [])
    present = {h.get('type') for h in hooks}
    for t in types:
        if t not in present:
            hooks.append(dict(type=t))
    cfg.custom_hooks = hooks


def setup_distributed(cfg: Config) -> None:
    """Prepare ``cfg`` (launcher already set) for a run without CUDA.

    Initialises a gloo process group from the launcher's environment and wraps
    the model in DDP with ``device_ids=None``. Does nothing on CUDA machines or
    for ``launcher='none'``.

    Raises:
        ValueError: the launcher is not ``pytorch`` (the only one that works
            without a GPU), or the model uses SyncBN, which gloo cannot run.
    """
    if cfg.launcher == 'none' or torch.cuda.is_available():
        return
    if cfg.launcher != 'pytorch':
        raise ValueError(f'launcher={cfg.launcher!r} needs GPUs; on CPUs use '
                         "launcher='pytorch' (torchrun) with the gloo backend")
    if 'SyncBN' in cfg.pretty_text:
        raise ValueError('the config uses SyncBN, which runs only on GPUs (NCCL); '
                         'for training on CPUs replace it by BN, GN or LN')
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group(backend='gloo')
    wrapper = cfg.get('model_wrapper_cfg') or dict(
        type='MMDistributedDataParallel', broadcast_buffers=False,
        find_unused_parameters=cfg.get('find_unused_parameters', False))
    wrapper['device_ids'] = None
    cfg.model_wrapper_cfg = wrapper
