import os
import pickle
from unittest.mock import patch

import numpy as np
import pytest
import torch

from flatten_mm import FLattenPVT, load_checkpoint_file
from flatten_mm.checkpoint import extract_state_dict

from official_format import write_official_checkpoint


def test_release_file_with_pickled_config_loads_tensors(tmp_path):
    path = str(tmp_path / 'flatten_pvt_t.pth')
    model = write_official_checkpoint(path, 'flatten_pvt_tiny', with_config=True)
    # torch's default refuses it ...
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    # ... our loader takes the tensors
    ckpt = load_checkpoint_file(path)
    sd = extract_state_dict(ckpt)
    assert ckpt['epoch'] == 299
    torch.testing.assert_close(sd['head.weight'], model.head.weight)
    assert len(sd) == len(model.state_dict())


class Exploit:
    def __reduce__(self):
        return (os.system, ('touch exploited_marker',))


def test_tampered_pickle_is_refused_not_executed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = str(tmp_path / 'evil.pth')
    torch.save({'model': {'w': torch.zeros(1)}, 'payload': Exploit()}, path)
    with pytest.raises(ValueError, match=r'refused to load: the pickle refers to (posix|os)\.system'):
        load_checkpoint_file(path)
    assert not (tmp_path / 'exploited_marker').exists()


def test_missing_and_non_checkpoint_files(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        load_checkpoint_file(str(tmp_path / 'nope.pth'))
    bad = tmp_path / 'text.pth'
    bad.write_text('not a checkpoint')
    with pytest.raises(ValueError, match='not a readable torch checkpoint'):
        load_checkpoint_file(str(bad))


def test_prefixes_and_nesting_are_handled():
    sd = extract_state_dict({'state_dict': {'backbone.a': torch.ones(1), 'meta': 3}})
    assert list(sd) == ['a']
    # a whole detector: only its backbone
    sd = extract_state_dict({'state_dict': {'module.backbone.b': torch.ones(1),
                                            'neck.c': torch.ones(2), 'rpn_head.d': torch.ones(3)}})
    assert list(sd) == ['b']
    with pytest.raises(ValueError, match='no tensors'):
        extract_state_dict({'model': {'x': 1}})
    # weights held as numpy arrays are named, not reported missing; scalars are metadata
    assert list(extract_state_dict({'w': torch.ones(1), 'best': np.float64(0.5)})) == ['w']
    with pytest.raises(ValueError, match=r"entries are arrays but not torch tensors: 'b' "
                                         r"\(numpy.ndarray\); convert them"):
        extract_state_dict({'model': {'a': torch.ones(1), 'b': np.ones(2)}})
    # ... among the entries taken only: not another part of a whole model's
    assert list(extract_state_dict({'backbone.a': torch.ones(1), 'head.b': np.ones(2)})) == ['a']
    assert list(extract_state_dict({'t.a': torch.ones(1), 's.a': np.ones(2)}, 't')) == ['a']
    # mmengine's Pretrained prefix, with its dot or without, under DDP's wrapper or not
    wrapped = {'state_dict': {'module.teacher.a': torch.ones(1),
                              'module.student.a': torch.zeros(1)}}
    for prefix in ('teacher', 'teacher.', 'module.teacher'):
        assert extract_state_dict(wrapped, prefix)['a'].item() == 1, prefix


def test_which_entry_of_a_file_is_loaded(tmp_path):
    """The release's 'model' (its published accuracy) before its EMA weights, and
    the log says so; an EMA-only file loads; an empty one is named with its keys."""
    from flatten_mm.checkpoint import read_state_dict
    both = tmp_path / 'both.pth'
    torch.save({'model': {'w': torch.ones(1)}, 'state_dict_ema': {'w': torch.zeros(1)}}, both)
    with patch('flatten_mm.checkpoint.print_log') as log:
        assert read_state_dict(str(both))['w'].item() == 1
    assert "holds the weights ['model', 'state_dict_ema']: loading 'model'" in str(log.call_args)
    ema = tmp_path / 'ema.pth'
    torch.save({'state_dict_ema': {'w': torch.zeros(1)}, 'epoch': 3}, ema)
    assert read_state_dict(str(ema))['w'].item() == 0
    empty = tmp_path / 'empty.pth'
    torch.save({'epoch': 3}, empty)
    with pytest.raises(ValueError,
                       match=r"empty.pth: checkpoint holds no tensors \(its keys: \['epoch'\]\)"):
        read_state_dict(str(empty))


def test_pretrained_init_changes_weights_and_logs(tmp_path):
    path = str(tmp_path / 'pvt_t.pth')
    model = write_official_checkpoint(path, 'flatten_pvt_tiny', with_config=True)
    dense = FLattenPVT(init_cfg=dict(type='Pretrained', checkpoint=path))
    before = dense.block1[0].attn.scale.clone()
    dense.init_weights()
    assert not torch.equal(before, dense.block1[0].attn.scale)
    torch.testing.assert_close(dense.block1[0].attn.scale, model.block1[0].attn.scale)
    torch.testing.assert_close(dense.pos_embed3, model.pos_embed3)


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    path = str(tmp_path / 'swin_t.pth')
    write_official_checkpoint(path, 'flatten_swin_tiny')
    dense = FLattenPVT(init_cfg=dict(type='Pretrained', checkpoint=path))
    with pytest.raises(ValueError, match='does not fit FLattenPVT: .*weights of the model are not '
                                         'in the checkpoint .*patch_embed1'):
        dense.init_weights()
    path = str(tmp_path / 'pvt_s.pth')
    write_official_checkpoint(path, 'flatten_pvt_small')
    dense = FLattenPVT(arch='tiny', init_cfg=dict(type='Pretrained', checkpoint=path))
    with pytest.raises(ValueError, match=r'have no place in the model \(block1\.2\.'):
        dense.init_weights()
    dense = FLattenPVT(arch='tiny', embed_dims=[32, 64, 160, 256],
                       init_cfg=dict(type='Pretrained', checkpoint=path))
    with pytest.raises(ValueError, match='size mismatch for patch_embed1.proj.weight'):
        dense.init_weights()


def test_missing_pretrained_file_is_named():
    dense = FLattenPVT(init_cfg=dict(type='Pretrained', checkpoint='/no/such/flatten.pth'))
    with pytest.raises(FileNotFoundError, match='/no/such/flatten.pth'):
        dense.init_weights()


def test_mmengine_checkpoints_load_under_torch_defaults(tmp_path):
    """mmengine stores numpy values and HistoryBuffers; torch >= 2.6 refuses
    them by default. After importing flatten_mm, mmengine's loaders read them."""
    import numpy as np
    from mmengine.logging import HistoryBuffer, MessageHub
    from mmengine.runner import load_checkpoint
    from mmengine.runner.checkpoint import _load_checkpoint, save_checkpoint

    model = torch.nn.Linear(3, 2)
    hub = MessageHub.get_instance('flatten_mm_test')
    hub.update_scalar('train/loss', np.float64(0.5))
    path = str(tmp_path / 'iter_1.pth')
    save_checkpoint({'meta': {'iter': np.int64(1), 'seed': np.array([3])},
                     'state_dict': model.state_dict(),
                     'message_hub': hub.state_dict()}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)
    ckpt = _load_checkpoint(path)
    buf = ckpt['message_hub']['log_scalars']['train/loss']
    assert isinstance(buf, HistoryBuffer) and buf.current() == 0.5
    assert ckpt['meta']['iter'] == 1
    other = torch.nn.Linear(3, 2)
    load_checkpoint(other, path)
    torch.testing.assert_close(other.weight, model.weight)


class SneakyAttr:
    def __reduce__(self):
        from mmengine.logging import HistoryBuffer
        return (getattr, (HistoryBuffer, '__init_subclass__'))


class WritesAFile:
    """Pickles as ``getattr(numpy.ndarray, 'tofile')(array, path)``: a public method
    of an allowed data type that writes any file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import numpy as np
        return (np.ndarray.tofile, (np.frombuffer(b'written', dtype=np.uint8), self.path))


def test_getattr_is_limited_to_data_methods(tmp_path):
    path = str(tmp_path / 'sneaky.pth')
    torch.save({'state_dict': {'w': torch.zeros(1)}, 'x': SneakyAttr()}, path)
    with pytest.raises(ValueError, match='refused to load: the pickle asks for '
                                         'mmengine.logging.history_buffer.HistoryBuffer.__init_subclass__'):
        load_checkpoint_file(path)


def test_methods_of_data_types_are_refused(tmp_path):
    """numpy.ndarray.tofile / .dump are public methods of an allowed type: a
    checkpoint calling them would write any file, here and through mmengine."""
    from mmengine.runner import load_checkpoint
    marker = tmp_path / 'marker'
    path = str(tmp_path / 'writes.pth')
    torch.save({'model': {'w': torch.zeros(1)}, 'config': WritesAFile(str(marker))}, path)
    with pytest.raises(ValueError, match='the pickle asks for numpy.ndarray.tofile'):
        load_checkpoint_file(path)
    with pytest.raises(ValueError, match='numpy.ndarray.tofile'):
        load_checkpoint(torch.nn.Linear(1, 1), path, logger='silent')
    assert not marker.exists()


def test_pretrained_from_a_url_is_downloaded_once_and_read_safely(tmp_path, monkeypatch):
    """mmengine's Pretrained takes URLs: a release file (with its pickled config)
    served over http loads through the safe loader, cached in torch's hub
    directory; a share link without a file name gets one; other schemes are
    refused by name."""
    import functools
    import http.server
    import threading
    served = tmp_path / 'served'
    served.mkdir()
    model = write_official_checkpoint(str(served / 'pvt_t.pth'), 'flatten_pvt_tiny',
                                      with_config=True)
    (served / 'share').mkdir()
    (served / 'share' / 'index.html').write_bytes((served / 'pvt_t.pth').read_bytes())
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(
        ('127.0.0.1', 0), functools.partial(Handler, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch_home'))
    base = f'http://127.0.0.1:{server.server_address[1]}'
    try:
        for url in (f'{base}/pvt_t.pth', f'{base}/share/', f'{base}/pvt_t.pth'):
            dense = FLattenPVT(init_cfg=dict(type='Pretrained', checkpoint=url))
            dense.init_weights()
            torch.testing.assert_close(dense.pos_embed3, model.pos_embed3)
    finally:
        server.shutdown()
    assert requests == ['/pvt_t.pth', '/share/']  # the second load of a URL reads the cache
    cached = os.listdir(tmp_path / 'torch_home' / 'hub' / 'checkpoints')  # hash-name
    assert sorted(name.split('-', 1)[1] for name in cached) == ['checkpoint.pth', 'pvt_t.pth']
    with pytest.raises(ValueError, match=r"'s3://bucket/a.pth': .* not s3://"):
        FLattenPVT(init_cfg=dict(type='Pretrained', checkpoint='s3://bucket/a.pth')).init_weights()
