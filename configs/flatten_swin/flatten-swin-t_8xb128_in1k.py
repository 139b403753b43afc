# FLatten-Swin-T on ImageNet-1K with mmpretrain, the release's (Swin's) recipe:
# 300 epochs, AdamW (weight decay 0.05), lr 5e-4 per 512 images (1e-3 at 8 GPUs x
# 128), linear warm-up for 20 epochs from 1e-6, cosine to 1e-5 (warm-up and final lr
# scaled by batch / 512 as the release does), gradient clipping 5.0, drop path 0.2,
# and the data and regularisation of flatten-pvt-t_8xb128_in1k.py.
_base_ = '../flatten_pvt/flatten-pvt-t_8xb128_in1k.py'

model = dict(
    backbone=dict(_delete_=True, type='FLattenSwin', arch='tiny', out_indices=(3, ),
                  attn_type='LLSS', drop_path_rate=0.2),
    head=dict(in_channels=768))

optim_wrapper = dict(clip_grad=dict(_delete_=True, max_norm=5.0))
warmup_epochs = 20
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=warmup_epochs)
]
