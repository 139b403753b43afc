# FLatten-CSwin-T on ImageNet-1K with mmpretrain, the release's recipe: 300 epochs,
# AdamW (weight decay 0.05), lr 5e-4 per 512 images (1e-3 at 8 GPUs x 128), linear
# warm-up for 20 epochs from 2e-6, cosine to 2e-5 (scaled by batch / 512 as the
# release does), no gradient clipping, drop path 0.2, and the data and
# regularisation of ../flatten_pvt/flatten-pvt-t_8xb128_in1k.py.
_base_ = '../flatten_pvt/flatten-pvt-t_8xb128_in1k.py'

model = dict(
    backbone=dict(_delete_=True, type='FLattenCSwin', arch='tiny', out_indices=(3, ),
                  attn_type='LLSS', split_size=(1, 2, 7, 7), drop_path_rate=0.2),
    head=dict(in_channels=512))

warmup_epochs = 20
param_scheduler = [
    dict(type='LinearLR', start_factor=2e-3, by_epoch=True, end=warmup_epochs,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=2e-5, by_epoch=True, begin=warmup_epochs)
]
