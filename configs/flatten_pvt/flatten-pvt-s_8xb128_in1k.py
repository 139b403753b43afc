# FLatten-PVT-S on ImageNet-1K: the recipe of flatten-pvt-t_8xb128_in1k.py with the
# release's drop path (0.1) and gradient clipping (None) for this size.
_base_ = './flatten-pvt-t_8xb128_in1k.py'

model = dict(backbone=dict(arch='small', drop_path_rate=0.1))
optim_wrapper = dict(clip_grad=None)
