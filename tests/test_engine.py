import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from flatten_mm import EmptyDatasetHook, load_checkpoint_file
from flatten_mm.engine import _IndexSkipper, get_random_state, set_random_state


def draws():
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_random_state_survives_a_checkpoint_file(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    draws()
    path = str(tmp_path / 'c.pth')
    torch.save({'random_state': get_random_state()}, path)
    expected = draws()
    draws()
    # plain types: torch's weights-only load reads it (no numpy pickles)
    state = torch.load(path, weights_only=True)['random_state']
    set_random_state(load_checkpoint_file(path)['random_state'])
    assert draws() == expected
    set_random_state(state)
    assert draws() == expected


def test_index_skipper_skips_without_loading_then_restores_state():
    loaded = []

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            loaded.append(i)
            return i
    loader = DataLoader(Data(), batch_size=2, shuffle=False)
    loop = SimpleNamespace(dataloader_iterator=SimpleNamespace(_iterator=iter(loader)))
    real = loop.dataloader_iterator
    torch.manual_seed(5)
    state = get_random_state()
    expected = draws()
    torch.manual_seed(0)
    loop.dataloader_iterator = _IndexSkipper(loop, 3, state)
    for _ in range(3):
        assert next(loop.dataloader_iterator) is None
    assert loop.dataloader_iterator is real and loaded == []
    assert draws() == expected
    assert next(real._iterator).tolist() == [6, 7]  # the 4th batch


def test_empty_dataset_hook_and_patch_name_the_dataset(tmp_path):
    runner = SimpleNamespace(train_dataloader=SimpleNamespace(dataset=[]))
    with pytest.raises(ValueError, match=r'the training dataset holds no samples \(list\)'):
        EmptyDatasetHook().before_train(runner)
    runner = SimpleNamespace(train_dataloader=SimpleNamespace(dataset=[1]))
    EmptyDatasetHook().before_train(runner)

    from mmengine.dataset import BaseDataset

    class Empty(BaseDataset):
        def load_data_list(self):
            return []
    with pytest.raises(ValueError, match=rf"the dataset holds no samples \(Empty, "
                                         rf"data_root='{tmp_path}'"):
        Empty(data_root=str(tmp_path), ann_file='')


def test_index_skipper_crosses_epochs_of_a_finite_sampler():
    from mmengine.runner.loops import _InfiniteDataloaderIterator
    loader = DataLoader(list(range(5)), batch_size=2, shuffle=False)
    real = _InfiniteDataloaderIterator(loader)
    loop = SimpleNamespace(dataloader_iterator=real)
    loop.dataloader_iterator = _IndexSkipper(loop, 4, get_random_state())
    for _ in range(4):  # 3 batches in an epoch: the 4th skip starts epoch 1
        next(loop.dataloader_iterator)
    assert loop.dataloader_iterator is real and real._epoch == 1
    assert next(real).tolist() == [2, 3]


def _adamw_with_paramwise_groups(model, **options):
    from mmengine.config import ConfigDict
    from mmengine.optim import build_optim_wrapper
    # as the Runner builds it: from a config's ConfigDict
    return build_optim_wrapper(model, ConfigDict(
        optimizer=dict(type='AdamW', lr=1e-2, weight_decay=0.05, **options),
        paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.0)})))


def test_plain_param_groups_hook_lets_compile_trace_the_optimizer_step():
    from mmengine.config import ConfigDict

    from flatten_mm import PlainParamGroupsHook

    def make():
        torch.manual_seed(0)
        model = torch.nn.ModuleDict(dict(fc=torch.nn.Linear(4, 3), norm=torch.nn.LayerNorm(3)))
        return model, _adamw_with_paramwise_groups(model)

    def step(model, wrapper):
        loss = model['norm'](model['fc'](torch.ones(2, 4))).pow(2).sum()
        wrapper.update_params(loss)

    eager_model, eager = make()
    compiled_model, wrapper = make()
    # the premise: mmengine's registry hands the optimizer ConfigDict groups
    assert all(type(g) is ConfigDict for g in wrapper.optimizer.param_groups)
    before = [dict(g) for g in wrapper.optimizer.param_groups]
    PlainParamGroupsHook().before_train(SimpleNamespace(optim_wrapper=wrapper))
    groups = wrapper.optimizer.param_groups
    assert all(type(g) is dict for g in groups) and groups == before
    assert [g['weight_decay'] for g in groups] == [0.05, 0.05, 0.0, 0.0]
    compiled = torch.compile(step)
    torch._dynamo.reset()
    for _ in range(2):
        step(eager_model, eager)
        compiled(compiled_model, wrapper)
    for a, b in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(a, b)
    assert wrapper.optimizer.state_dict()['state'][0]['step'] == 2


def test_eager_optimizer_step_hook_leaves_the_step_out_of_compiled_graphs():
    """compile=True's train_step with our configs' optimizer (fused AdamW, one
    parameter group per parameter under a paramwise_cfg, gradient clipping, a
    scheduler that wraps the step): with the hook the step runs eagerly, so
    fewer frames are compiled, as many for more groups, and the parameters
    equal eager training. (In the demo Mask R-CNN dynamo compiled the step of
    each group until its recompile limit: test_training_reliability.py.)"""
    from mmengine.config import ConfigDict
    from mmengine.optim import LinearLR, build_optim_wrapper
    from torch._dynamo.testing import CompileCounter

    from flatten_mm import EagerOptimizerStepHook, PlainParamGroupsHook

    def make(layers, eager_step):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
        wrapper = build_optim_wrapper(model, ConfigDict(
            optimizer=dict(type='AdamW', lr=1e-2, weight_decay=0.05, fused=True),
            paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.0)}),
            clip_grad=dict(max_norm=5.0)))
        LinearLR(wrapper, start_factor=0.5, by_epoch=False, begin=0, end=10)
        runner = SimpleNamespace(optim_wrapper=wrapper)
        PlainParamGroupsHook().before_train(runner)
        if eager_step:
            EagerOptimizerStepHook().before_train(runner)
            step = wrapper.step
            EagerOptimizerStepHook().before_train(runner)  # a second train(): as it was
            assert wrapper.step is step
        assert len(wrapper.optimizer.param_groups) == 2 * layers
        return model, wrapper

    def step(model, wrapper):
        wrapper.update_params(model(torch.ones(2, 4)).pow(2).sum())

    def frames(layers, eager_step):
        model, wrapper = make(layers, eager_step)
        counter = CompileCounter()
        compiled = torch.compile(step, backend=counter)
        torch._dynamo.reset()
        for _ in range(2):
            compiled(model, wrapper)
        return counter.frame_count, model

    eager_model, eager = make(3, False)
    for _ in range(2):
        step(eager_model, eager)
    (two, _), (three, model) = frames(2, True), frames(3, True)
    for a, b in zip(eager_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert two == three < frames(3, False)[0]


def test_plain_param_groups_hook_converts_every_optimizer_of_a_dict():
    from mmengine.optim import OptimWrapperDict

    from flatten_mm import PlainParamGroupsHook
    nets = [torch.nn.ModuleDict(dict(fc=torch.nn.Linear(2, 2), norm=torch.nn.LayerNorm(2)))
            for _ in range(2)]
    wrappers = OptimWrapperDict(gen=_adamw_with_paramwise_groups(nets[0]),
                                disc=_adamw_with_paramwise_groups(nets[1]))
    PlainParamGroupsHook().before_train(SimpleNamespace(optim_wrapper=wrappers))
    for wrapper in wrappers.values():
        groups = wrapper.optimizer.param_groups
        assert all(type(g) is dict for g in groups) and len(groups) == 4
