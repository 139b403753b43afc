# FLatten-PVT-T on ImageNet-1K with mmpretrain, the release's recipe: 300 epochs,
# AdamW (weight decay 0.05), lr 5e-4 per 512 images (1e-3 at 8 GPUs x 128), linear
# warm-up for 5 epochs from 2e-6, cosine to 2e-5 (the release scales its warm-up
# and final lr by batch / 512 too), label smoothing 0.1, Mixup 0.8 / CutMix 1.0
# (one of them per batch), RandAugment m9 mstd 0.5, random erasing 0.25,
# no gradient clipping. Norms, biases, positional embeddings/encodings and the
# focusing scale take no weight decay (see docs/pretraining.md).
_base_ = [
    'mmpretrain::_base_/datasets/imagenet_bs64_swin_224.py',
    'mmpretrain::_base_/schedules/imagenet_bs1024_adamw_swin.py',
    'mmpretrain::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

model = dict(
    type='ImageClassifier',
    backbone=dict(type='FLattenPVT', arch='tiny', out_indices=(3, ), drop_path_rate=0.1),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(
        type='LinearClsHead',
        num_classes=1000,
        in_channels=512,
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),
        init_cfg=dict(type='TruncNormal', layer='Linear', std=.02, bias=0.),
        cal_acc=False),
    train_cfg=dict(augments=[dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]))

train_dataloader = dict(batch_size=128)
val_dataloader = dict(batch_size=128)
test_dataloader = val_dataloader

optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05, eps=1e-8, betas=(0.9, 0.999)),
    paramwise_cfg=dict(
        norm_decay_mult=0.0,
        bias_decay_mult=0.0,
        flat_decay_mult=0.0,
        custom_keys={
            'pos_embed': dict(decay_mult=0.0),
            'positional_encoding': dict(decay_mult=0.0),
            'relative_position_bias_table': dict(decay_mult=0.0),
            '.scale': dict(decay_mult=0.0)}),
    clip_grad=None)

warmup_epochs = 5
param_scheduler = [
    dict(type='LinearLR', start_factor=2e-3, by_epoch=True, end=warmup_epochs,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=2e-5, by_epoch=True, begin=warmup_epochs)
]
train_cfg = dict(by_epoch=True, max_epochs=300, val_interval=1)
# lr above is for 8 x 128 images; `--auto-scale-lr` style scaling keeps 5e-4 per 512
auto_scale_lr = dict(base_batch_size=1024)
