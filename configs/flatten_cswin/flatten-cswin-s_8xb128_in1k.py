# FLatten-CSwin-S on ImageNet-1K: flatten-cswin-t_8xb128_in1k.py with drop path 0.4.
_base_ = './flatten-cswin-t_8xb128_in1k.py'

model = dict(backbone=dict(arch='small', drop_path_rate=0.4))
