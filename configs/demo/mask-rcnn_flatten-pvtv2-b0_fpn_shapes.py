# `make demo`'s detection run: Mask R-CNN with a FLatten-PVTv2-B0 backbone on the
# built-in shapes data, the recipe of mask-rcnn_flatten-pvt-t_fpn_shapes.py with
# the lighter backbone (0.6 GFLOPs at 224x224 against FLatten-PVT-T's 2.0; a step
# takes about half as long), which affords 450 iterations in the demo's budget.
_base_ = './mask-rcnn_flatten-pvt-t_fpn_shapes.py'

max_iters = 450
model = dict(
    backbone=dict(type='FLattenPVTv2', arch='b0'),
    neck=dict(in_channels=[32, 64, 160, 256]))
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=100),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=100, end=max_iters, eta_min=1e-5),
]
default_hooks = dict(checkpoint=dict(interval=max_iters))
