# FLatten-PVTv2-B0 on ImageNet-1K with mmpretrain: the release's recipe, as
# ../flatten_pvt/flatten-pvt-t_8xb128_in1k.py (300 epochs, AdamW, lr 1e-3 at 8 x 128,
# 5 warm-up epochs, cosine to 2e-5, drop path 0.1, no gradient clipping).
_base_ = '../flatten_pvt/flatten-pvt-t_8xb128_in1k.py'

model = dict(
    backbone=dict(_delete_=True, type='FLattenPVTv2', arch='b0', out_indices=(3, ),
                  drop_path_rate=0.1),
    head=dict(in_channels=256))
