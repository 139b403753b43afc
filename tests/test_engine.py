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
