# Image classification with a FLatten-Swin-T backbone on the built-in shapes
# data (tools/make_demo_data.py writes data/shapes/cls in the ImageFolder
# layout: one circle, square or triangle per image). Sized for comparing
# attention designs on 2 CPU cores (tools/analysis_tools/compare_attention.py):
# trained from scratch at 64x64, batches of 16, fused AdamW, iteration-based.
# The tool sets model.backbone.attn_design (and knobs) per design.
_base_ = ['mmpretrain::_base_/default_runtime.py']
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

data_root = 'data/shapes/cls/'
img_size = 64
max_iters = 300
num_classes = 3

data_preprocessor = dict(
    num_classes=num_classes,
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    to_rgb=True)
model = dict(
    type='ImageClassifier',
    backbone=dict(type='FLattenSwin', arch='tiny', attn_type='LLSS', window_size=7,
                  linear_window=None, drop_path_rate=0.1, out_indices=(3, ), init_cfg=None),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(type='LinearClsHead', num_classes=num_classes, in_channels=768,
              loss=dict(type='CrossEntropyLoss', loss_weight=1.0)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(img_size, img_size)),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(img_size, img_size)),
    dict(type='PackInputs'),
]
train_dataloader = dict(
    batch_size=16,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(type='CustomDataset', data_root=data_root, data_prefix='train',
                 with_label=True, pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=32,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(type='CustomDataset', data_root=data_root, data_prefix='val',
                 with_label=True, pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_evaluator = val_evaluator

train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict()
test_cfg = dict()

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-3, betas=(0.9, 0.999), weight_decay=0.05, fused=True),
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0, custom_keys={
        'positional_encoding': dict(decay_mult=0.),
        'relative_position_bias_table': dict(decay_mult=0.)}),
    clip_grad=dict(max_norm=5.0))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=30),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=False, begin=30, end=max_iters),
]
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=20, log_metric_by_epoch=False),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters,
                    max_keep_ckpts=1))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
