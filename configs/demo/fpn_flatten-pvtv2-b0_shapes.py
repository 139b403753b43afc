# `make demo`'s segmentation run: Semantic FPN with a FLatten-PVTv2-B0 backbone on
# the built-in shapes data, the recipe of fpn_flatten-pvt-t_shapes.py with the
# lighter backbone, whose steps take half as long: 3000 iterations fit the
# demo's budget (FLatten-PVT-T managed 1600).
_base_ = './fpn_flatten-pvt-t_shapes.py'

max_iters = 3000
model = dict(
    backbone=dict(type='FLattenPVTv2', arch='b0'),
    neck=dict(in_channels=[32, 64, 160, 256]))
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(type='PolyLR', power=1.0, eta_min=0.0, by_epoch=False, begin=50, end=max_iters),
]
default_hooks = dict(checkpoint=dict(interval=max_iters))
