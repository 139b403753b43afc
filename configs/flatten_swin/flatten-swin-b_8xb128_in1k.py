# FLatten-Swin-B on ImageNet-1K: flatten-swin-t_8xb128_in1k.py with drop path 0.5.
_base_ = './flatten-swin-t_8xb128_in1k.py'

model = dict(backbone=dict(arch='base', drop_path_rate=0.5), head=dict(in_channels=1024))
