# FLatten-Swin-B at 384x384: the release fine-tunes the 224 model for 30 epochs
# (AdamW, weight decay 1e-8, lr 2e-5 per 512 images, 5 warm-up epochs from 2e-8,
# cosine to 2e-7, clipping 5.0, drop path 0.5), with windows of 12 and the linear
# stages' positional encodings resized from the 224 grids on load.
_base_ = './flatten-swin-b_8xb128_in1k.py'

model = dict(backbone=dict(pretrain_img_size=384, window_size=12))
load_from = 'work_dirs/flatten-swin-b_8xb128_in1k/epoch_300.pth'

# the pretraining augmentation at 384; tested at 384 without a crop, as the release
bgr_mean = [103.53, 116.28, 123.675]
bgr_std = [57.375, 57.12, 58.395]
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=384, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='RandAugment', policies='timm_increasing', num_policies=2, total_level=10,
         magnitude_level=9, magnitude_std=0.5,
         hparams=dict(pad_val=[round(x) for x in bgr_mean], interpolation='bicubic')),
    dict(type='RandomErasing', erase_prob=0.25, mode='rand', min_area_ratio=0.02,
         max_area_ratio=1 / 3, fill_color=bgr_mean, fill_std=bgr_std),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=384, backend='pillow', interpolation='bicubic'),
    dict(type='PackInputs'),
]
train_dataloader = dict(batch_size=64, dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(batch_size=64, dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
optim_wrapper = dict(optimizer=dict(lr=2e-5, weight_decay=1e-8))
warmup_epochs = 5
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=2e-7, by_epoch=True, begin=warmup_epochs)
]
train_cfg = dict(max_epochs=30)
auto_scale_lr = dict(base_batch_size=512)
