# The short run of fpn_flatten-pvtv2-b0_shapes.py (Semantic FPN, FLatten-PVTv2-B0,
# linear attention in all four stages): 600 iterations with the schedule ended
# there, for tools/analysis_tools/compare_attention.py, which trains it once per
# attention design on 2 CPU cores (about 2 minutes per design on one thread).
_base_ = './fpn_flatten-pvtv2-b0_shapes.py'

max_iters = 600
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(type='PolyLR', power=1.0, eta_min=0.0, by_epoch=False, begin=50, end=max_iters),
]
default_hooks = dict(checkpoint=dict(interval=max_iters))
