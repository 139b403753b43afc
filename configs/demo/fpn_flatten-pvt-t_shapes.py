# Semantic FPN with a FLatten-PVT-T backbone on the built-in shapes data
# (tools/make_demo_data.py), in ADE20K's folder layout. Same model code as the
# ADE20K config; data, schedule, image size and head width are cut to fit the
# demo's budget on 2 CPU cores (it trains on one thread, next to the detection
# demo): images resized to 96x96 (predictions are scored at the original
# 128x128; 80x80 and 112x112 learnt less in the same time), batches of 4, a
# 64-channel neck and head, and a Dice loss weighted 3 next to cross-entropy.
# GroupNorm in the head (no SyncBN) lets the same config run distributed on CPUs.
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

data_root = 'data/shapes/ade/'
metainfo = dict(classes=('background', 'circle', 'square', 'triangle'),
                palette=[[0, 0, 0], [220, 20, 60], [0, 128, 255], [0, 200, 0]])
img_size = (96, 96)
head_dims = 64
max_iters = 1600
norm_cfg = dict(type='GN', num_groups=16, requires_grad=True)

model = dict(
    data_preprocessor=dict(size=img_size),
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='FLattenPVT',
        arch='tiny',
        drop_path_rate=0.0,
        out_indices=(0, 1, 2, 3),
        init_cfg=None),  # trained from scratch on the demo data
    neck=dict(in_channels=[64, 128, 320, 512], out_channels=head_dims, num_outs=4),
    decode_head=dict(
        in_channels=[head_dims] * 4,
        channels=head_dims,
        dropout_ratio=0.0,
        num_classes=4,
        norm_cfg=norm_cfg,
        loss_decode=[
            dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0),
            dict(type='DiceLoss', loss_weight=3.0)]))

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
dataset = dict(
    type='BaseSegDataset',
    data_root=data_root,
    metainfo=metainfo,
    img_suffix='.jpg',
    seg_map_suffix='.png',
    reduce_zero_label=False)
train_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(**dataset,
                 data_prefix=dict(img_path='images/training',
                                  seg_map_path='annotations/training'),
                 pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=8,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(**dataset,
                 data_prefix=dict(img_path='images/validation',
                                  seg_map_path='annotations/validation'),
                 pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='IoUMetric', iou_metrics=['mIoU'])
test_evaluator = val_evaluator

train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')

optim_wrapper = dict(
    type='OptimWrapper',
    # fused: one kernel for all parameters (torch >= 2.4 on CPU), 4x faster steps
    optimizer=dict(type='AdamW', lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, fused=True),
    paramwise_cfg=dict(custom_keys={
        'pos_embed': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}),
    clip_grad=dict(max_norm=5.0))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(type='PolyLR', power=1.0, eta_min=0.0, by_epoch=False, begin=50, end=max_iters),
]
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=20, log_metric_by_epoch=False),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters,
                    max_keep_ckpts=1),
    visualization=dict(type='SegVisualizationHook'))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
