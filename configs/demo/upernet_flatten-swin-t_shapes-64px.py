# UperNet with a FLatten-Swin-T backbone on the built-in shapes data at 64x64
# (upernet_flatten-swin-t_shapes.py with the images resized to 64x64, scored
# at the original size): the short dense run of
# tools/analysis_tools/compare_attention.py, which trains it once per
# attention design on 2 CPU cores (400 iterations, evaluation at the end).
_base_ = './upernet_flatten-swin-t_shapes.py'

img_size = (64, 64)
max_iters = 400
model = dict(data_preprocessor=dict(size=img_size))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=False),
    dict(type='Resize', scale=img_size, keep_ratio=False),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=img_size, keep_ratio=False),
    dict(type='LoadAnnotations', reduce_zero_label=False),
    dict(type='PackSegInputs'),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=30),
    dict(type='PolyLR', power=1.0, eta_min=0.0, by_epoch=False, begin=30, end=max_iters),
]
default_hooks = dict(checkpoint=dict(interval=max_iters))
