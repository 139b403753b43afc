# FLatten-DeiT-B on ImageNet-1K: the recipe of flatten-deit-t_8xb128_in1k.py
# (DeiT's) with the base model (768 wide, 12 heads).
_base_ = './flatten-deit-t_8xb128_in1k.py'

model = dict(backbone=dict(arch='base'), head=dict(in_channels=768))
