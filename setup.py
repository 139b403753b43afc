"""Installs flatten_mm, Focused Linear Attention backbones for OpenMMLab."""
import os
import os.path as osp
import shutil
import sys

from setuptools import find_packages, setup

# What mim needs inside the installed package: `mim list` / `mim search` read
# model-index.yml, `mim train flatten_mm CONFIG` runs tools/train.py on configs/.
MIM_FILES = ('configs', 'tools', 'model-index.yml')


def read_version_file() -> dict:
    """The names flatten_mm/version.py defines (the package itself needs torch)."""
    path = os.path.join(os.path.dirname(__file__), 'flatten_mm', 'version.py')
    scope: dict = {}
    with open(path) as f:
        exec(f.read(), scope)
    return scope


def add_mim_extension() -> None:
    """Put ``MIM_FILES`` into ``flatten_mm/.mim``: links for a develop-style
    editable install (edits stay visible), copies for wheels and sdists."""
    if {'develop', 'editable_wheel'} & set(sys.argv):
        mode = 'symlink'
    elif {'install', 'bdist_wheel', 'sdist', 'build'} & set(sys.argv):
        mode = 'copy'
    else:
        return
    root = osp.dirname(osp.abspath(__file__))
    mim_dir = osp.join(root, 'flatten_mm', '.mim')
    os.makedirs(mim_dir, exist_ok=True)
    for name in MIM_FILES:
        src, dst = osp.join(root, name), osp.join(mim_dir, name)
        if osp.islink(dst) or osp.isfile(dst):
            os.remove(dst)
        elif osp.isdir(dst):
            shutil.rmtree(dst)
        if mode == 'symlink':
            os.symlink(osp.relpath(src, mim_dir), dst)
        elif osp.isdir(src):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
        else:
            shutil.copyfile(src, dst)


add_mim_extension()
VERSION_FILE = read_version_file()
setup(
    name='flatten_mm',
    version=VERSION_FILE['__version__'],
    description='FLatten (Focused Linear Attention) backbones for mmdet, '
    'mmsegmentation and timm',
    long_description=open('README.md').read() if os.path.exists('README.md') else '',
    long_description_content_type='text/markdown',
    license='Apache License 2.0',
    python_requires='>=3.10',  # torch >= 2.11's
    packages=find_packages(exclude=('tests', 'tests.*', 'configs', 'tools')),
    include_package_data=True,
    # mmengine (0.10.7 and before) looks up the packages of `mmdet::` / `mmseg::`
    # config bases through pkg_resources, which setuptools 82 removed
    install_requires=[f"torch>={VERSION_FILE['TORCH_MINIMUM']}", 'mmengine>=0.10.0,<1.0',
                      'setuptools<82'],
    extras_require={
        'det': ['mmcv>=2.0.0,<2.2.0', 'mmdet>=3.0.0,<3.4.0'],
        'seg': ['mmcv>=2.0.0,<2.2.0', 'mmsegmentation>=1.0.0,<1.3.0'],
        'timm': ['timm>=0.9'],
    },
    zip_safe=False,
)
