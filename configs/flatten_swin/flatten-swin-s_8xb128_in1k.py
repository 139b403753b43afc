# FLatten-Swin-S on ImageNet-1K: flatten-swin-t_8xb128_in1k.py with drop path 0.3.
_base_ = './flatten-swin-t_8xb128_in1k.py'

model = dict(backbone=dict(arch='small', drop_path_rate=0.3))
