"""mim sees the package: model-index.yml and metafiles cover every config,
the editable (develop) install is listed and searchable, and a wheel ships
.mim/ (configs, tools, model index) so that `mim train` works from it."""
import glob
import os
import os.path as osp
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
import yaml

from demo_runs import ROOT, heavy_first, losses, run, seg_options, worker_threads

BIN = osp.dirname(sys.executable)
MODEL_FOLDERS = ('flatten_pvt', 'flatten_swin', 'flatten_cswin', 'flatten_pvtv2', 'flatten_deit',
                 'baselines', 'attention_designs')


def metafile_models():
    index = yaml.safe_load(open(osp.join(ROOT, 'model-index.yml')))
    models = []
    for path in index['Import']:
        models += yaml.safe_load(open(osp.join(ROOT, path)))['Models']
    return models


def test_model_index_covers_every_config():
    models = metafile_models()
    listed = sorted(m['Config'] for m in models)
    on_disk = sorted(osp.relpath(p, ROOT) for folder in MODEL_FOLDERS
                     for p in glob.glob(osp.join(ROOT, 'configs', folder, '*.py')))
    assert listed == on_disk
    for m in models:
        assert m['Name'] == osp.splitext(osp.basename(m['Config']))[0]
        assert m['Metadata']['Training Data'] in ('COCO', 'ADE20K', 'ImageNet-1k')


def mim(*args, env=None, cwd=ROOT):
    return run(osp.join(BIN, 'mim'), *args, cwd=cwd, env=env, python=False)


def test_mim_lists_and_searches_the_editable_install():
    listed = [line.split() for line in mim('list').splitlines()]
    assert ['flatten-mm', __import__('flatten_mm').__version__, ROOT] in listed
    found = mim('search', 'flatten_mm')
    for m in metafile_models():
        assert f'config id: {m["Name"]}\n' in found


def copy_sources(dst):
    files = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if osp.isfile(osp.join(ROOT, f)):
            os.makedirs(osp.dirname(osp.join(dst, f)), exist_ok=True)
            shutil.copy2(osp.join(ROOT, f), osp.join(dst, f))


@pytest.mark.heavy(20)
def test_wheel_ships_mim_files_and_mim_trains_from_it(shapes, tmp_path):
    src, target = str(tmp_path / 'src'), str(tmp_path / 'site')
    copy_sources(src)
    run('-m', 'pip', 'wheel', '-q', '.', '--no-deps', '--no-build-isolation',
        '-w', 'dist', cwd=src)
    wheel = glob.glob(osp.join(src, 'dist', 'flatten_mm-*.whl'))[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ('model-index.yml', 'tools/train.py', 'tools/common.py', 'tools/test.py',
              'configs/flatten_pvt/metafile.yml', 'configs/demo/fpn_flatten-pvt-t_shapes.py',
              'configs/flatten_swin/upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py'):
        assert f'flatten_mm/.mim/{f}' in names
    assert not any(n.startswith('tests/') for n in names)
    metadata = next(zipfile.ZipFile(wheel).read(n).decode() for n in names
                    if n.endswith('.dist-info/METADATA'))
    lines = metadata.splitlines()
    assert 'Requires-Dist: torch>=2.11' in lines and 'Requires-Dist: setuptools<82' in lines
    assert 'Requires-Python: >=3.10' in lines

    # mim's own installer (pip underneath) with the wheel, into a separate folder
    mim('install', wheel, '--no-deps', '--target', target,
        env=dict(MMCV_BASE_URL='file:///nonexistent'))  # no network here
    env = dict(PYTHONPATH=target)
    listed = [line.split() for line in mim('list', env=env, cwd=str(tmp_path)).splitlines()]
    # the wheel's row (no home page; the editable install's row names ROOT)
    assert ['flatten-mm', __import__('flatten_mm').__version__] in listed
    work = str(tmp_path / 'work')
    log = mim('train', 'flatten_mm', 'fpn_flatten-pvt-t_shapes.py', '--launcher', 'none',
              '--work-dir', work, *seg_options(shapes, 2), env=env, cwd=str(tmp_path))
    assert osp.join(target, 'flatten_mm', '.mim', 'tools', 'train.py') in log
    assert len(losses(log)) == 2 and osp.exists(osp.join(work, 'iter_2.pth'))


def test_mim_install_editable_into_an_environment_with_the_stack(tmp_path):
    """`mim install -e .` in another environment that already has the
    OpenMMLab stack (this one's packages, reached through a .pth file)."""
    import sysconfig
    src, venv = str(tmp_path / 'src'), str(tmp_path / 'venv')
    copy_sources(src)
    run('-m', 'venv', venv, cwd=str(tmp_path))
    site = subprocess.run([osp.join(venv, 'bin', 'python'), '-c',
                           'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(osp.join(site, 'openmmlab_stack.pth'), 'w') as f:
        f.write(sysconfig.get_paths()['purelib'] + '\n')
    py = osp.join(venv, 'bin', 'python')
    run(py, '-m', 'mim', 'install', '-e', '.', '--no-deps', '--no-build-isolation',
        cwd=src, python=False, env=dict(MMCV_BASE_URL='file:///nonexistent'))
    where = run(py, '-c', 'import flatten_mm, mmdet, mmseg; print(flatten_mm.__file__)',
                cwd=str(tmp_path), python=False)
    assert where.strip().endswith(osp.join(src, 'flatten_mm', '__init__.py'))
    listed = [line.split() for line in run(py, '-m', 'mim', 'list', cwd=str(tmp_path),
                                            python=False).splitlines()]
    assert ['flatten-mm', __import__('flatten_mm').__version__, src] in listed
    # this environment's own editable install is untouched
    here = run('-c', 'import flatten_mm; print(flatten_mm.__file__)', cwd=str(tmp_path))
    assert here.strip() == osp.join(ROOT, 'flatten_mm', '__init__.py')
    assert osp.islink(osp.join(ROOT, 'flatten_mm', '.mim', 'configs'))


def test_an_older_torch_is_refused_at_import_by_name():
    """Below the oldest torch the suite passes on, importing flatten_mm raises an
    ImportError naming the version found and the one needed (torch 2.6 had failed
    inside an import of torch.fx, 2.9 inside torch.jit.trace)."""
    from flatten_mm.version import TORCH_MINIMUM, check_torch
    assert TORCH_MINIMUM == '2.11'
    for ok in ('2.11.0+cu130', '2.11.1', '2.14.1+cpu', '3.0.0'):
        check_torch(ok)
    for old in ('2.9.1+cu128', '2.6.0', '1.13.1'):
        with pytest.raises(ImportError, match=rf'torch >= 2\.11, found torch {re.escape(old)}'):
            check_torch(old)


def test_heavy_tests_run_first(request):
    """Tests marked heavy come first in the order pytest-xdist shares out (this
    session's order too), the longest first, the rest after them in their order."""
    class Item:
        def __init__(self, name: str, seconds: float = 0, mark=None):
            self.nodeid, self.mark = name, mark
            if seconds:
                self.mark = pytest.mark.heavy(seconds).mark

        def get_closest_marker(self, name: str):
            return self.mark

    items = [Item('a'), Item('b', 20), Item('c'), Item('d', 90), Item('e', 20)]
    heavy_first(items)
    assert [item.nodeid for item in items] == ['d', 'b', 'e', 'a', 'c']
    with pytest.raises(ValueError, match=r'x: heavy takes the seconds .* got \(\)'):
        heavy_first([Item('a', 20), Item('x', mark=pytest.mark.heavy.mark)])
    seconds = [mark.args[0] if mark else 0
               for mark in (item.get_closest_marker('heavy') for item in request.session.items)]
    assert seconds == sorted(seconds, reverse=True)


def test_make_test_workers_share_the_cores():
    """`make test` runs pytest-xdist workers; each gets its share of the cores
    as torch's threads, and so does every script a test starts."""
    make = open(osp.join(ROOT, 'Makefile')).read()
    assert re.search(r'pytest -q -n \$\(TEST_JOBS\)', make) and 'TEST_JOBS ?= 2' in make
    assert worker_threads({}) is None
    assert worker_threads({'PYTEST_XDIST_WORKER_COUNT': '2'}, cpus=2) == 1
    assert worker_threads({'PYTEST_XDIST_WORKER_COUNT': '2'}, cpus=16) == 8
    assert worker_threads({'PYTEST_XDIST_WORKER_COUNT': '4'}, cpus=2) == 1
    # a smaller OMP_NUM_THREADS already set is kept, a larger one or a list is not
    for preset, want in (('3', 3), ('12', 8), ('4,2', 8)):
        env = {'PYTEST_XDIST_WORKER_COUNT': '2', 'OMP_NUM_THREADS': preset}
        assert worker_threads(env, cpus=16) == want
    share = worker_threads(os.environ)
    if share is None:
        pytest.skip('one process: the suite runs outside pytest-xdist')
    assert os.environ['OMP_NUM_THREADS'] == str(share) and torch.get_num_threads() == share
    out = run('-c', 'import torch; print(torch.get_num_threads())', cwd=ROOT)
    assert int(out.split()[-1]) == share
