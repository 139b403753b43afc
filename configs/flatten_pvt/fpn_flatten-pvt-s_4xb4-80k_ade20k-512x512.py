# Semantic FPN with FLatten-PVT-S on ADE20K. No ImageNet weights were released
# for FLatten-PVT-S: pretrain them with timm (flatten_pvt_small, see the README).
_base_ = './fpn_flatten-pvt-t_4xb4-80k_ade20k-512x512.py'
model = dict(backbone=dict(arch='small', init_cfg=None))
