# Mask R-CNN with a FLatten-PVT-T backbone on the built-in shapes data
# (tools/make_demo_data.py). Same model code as the COCO config; the data, the
# schedule, the image size, the neck width and the numbers of proposals and
# sampled RoIs are cut to fit a few minutes on 2 CPU cores. Trained from
# scratch, so GroupNorm in the neck and the mask head keeps the early iterations
# stable; the box head is the COCO config's two-FC head (a four-conv GN head
# cost 30% more per step for a lower box mAP); data loads in the main process.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

data_root = 'data/shapes/'
metainfo = dict(classes=('circle', 'square', 'triangle'),
                palette=[(220, 20, 60), (0, 128, 255), (0, 200, 0)])
img_size = 128
neck_dims = 64
max_iters = 280
gn = dict(type='GN', num_groups=16, requires_grad=True)

model = dict(
    data_preprocessor=dict(pad_size_divisor=32),
    backbone=dict(
        _delete_=True,
        type='FLattenPVT',
        arch='tiny',
        drop_path_rate=0.0,
        out_indices=(0, 1, 2, 3),
        init_cfg=None),  # trained from scratch on the demo data
    neck=dict(in_channels=[64, 128, 320, 512], out_channels=neck_dims, norm_cfg=gn),
    rpn_head=dict(
        in_channels=neck_dims,
        feat_channels=neck_dims,
        anchor_generator=dict(scales=[4], ratios=[0.5, 1.0, 2.0])),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=neck_dims),
        bbox_head=dict(in_channels=neck_dims, fc_out_channels=256, num_classes=3),
        mask_roi_extractor=dict(out_channels=neck_dims),
        mask_head=dict(in_channels=neck_dims, conv_out_channels=neck_dims, norm_cfg=gn,
                       num_classes=3)),
    train_cfg=dict(
        rpn=dict(sampler=dict(num=128)),
        rpn_proposal=dict(nms_pre=500, max_per_img=200),
        rcnn=dict(sampler=dict(num=64))),
    test_cfg=dict(
        rpn=dict(nms_pre=300, max_per_img=100),
        rcnn=dict(max_per_img=20)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(img_size, img_size), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(img_size, img_size), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=8,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    batch_sampler=dict(type='AspectRatioBatchSampler'),
    dataset=dict(
        type='CocoDataset',
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_train.json',
        data_prefix=dict(img='images/train/'),
        filter_cfg=dict(filter_empty_gt=True, min_size=4),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=8,
    num_workers=0,
    persistent_workers=False,
    drop_last=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type='CocoDataset',
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_val.json',
        data_prefix=dict(img='images/val/'),
        test_mode=True,
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(
    type='CocoMetric',
    ann_file=data_root + 'annotations/instances_val.json',
    metric=['bbox', 'segm'])
test_evaluator = val_evaluator

train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')

optim_wrapper = dict(
    type='OptimWrapper',
    # fused: one kernel for all parameters (torch >= 2.4 on CPU), 4x faster steps
    optimizer=dict(type='AdamW', lr=6e-4, betas=(0.9, 0.999), weight_decay=0.05,
                   fused=True),
    paramwise_cfg=dict(custom_keys={
        'pos_embed': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}),
    clip_grad=dict(max_norm=5.0))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=100),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=100, end=max_iters, eta_min=1e-5),
]
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=10),  # a progress line every ~20 s on 1 core
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters,
                    max_keep_ckpts=1))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
