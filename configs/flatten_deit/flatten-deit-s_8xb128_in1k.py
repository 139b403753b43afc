# FLatten-DeiT-S on ImageNet-1K: the recipe of flatten-deit-t_8xb128_in1k.py
# (DeiT's) with the small model (384 wide, 6 heads).
_base_ = './flatten-deit-t_8xb128_in1k.py'

model = dict(backbone=dict(arch='small'), head=dict(in_channels=384))
