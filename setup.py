"""Installs flatten_mm, Focused Linear Attention backbones for OpenMMLab."""
import os

from setuptools import find_packages, setup


def read_version() -> str:
    path = os.path.join(os.path.dirname(__file__), 'flatten_mm', 'version.py')
    scope: dict = {}
    with open(path) as f:
        exec(f.read(), scope)
    return scope['__version__']


setup(
    name='flatten_mm',
    version=read_version(),
    description='FLatten (Focused Linear Attention) backbones for mmdet, '
    'mmsegmentation and timm',
    long_description=open('README.md').read() if os.path.exists('README.md') else '',
    long_description_content_type='text/markdown',
    license='Apache License 2.0',
    python_requires='>=3.8',
    packages=find_packages(exclude=('tests', 'tests.*', 'configs', 'tools')),
    include_package_data=True,
    install_requires=['torch>=1.13', 'mmengine>=0.10.0,<1.0'],
    extras_require={
        'det': ['mmcv>=2.0.0,<2.2.0', 'mmdet>=3.0.0,<3.4.0'],
        'seg': ['mmcv>=2.0.0,<2.2.0', 'mmsegmentation>=1.0.0,<1.3.0'],
        'timm': ['timm>=0.9'],
    },
    zip_safe=False,
)
