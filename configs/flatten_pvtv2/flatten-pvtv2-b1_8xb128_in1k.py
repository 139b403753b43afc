# FLatten-PVTv2-B1 on ImageNet-1K: the recipe of flatten-pvtv2-b0_8xb128_in1k.py with
# the release's drop path (0.1) and gradient clipping (None) for this size.
_base_ = './flatten-pvtv2-b0_8xb128_in1k.py'

model = dict(backbone=dict(arch='b1', drop_path_rate=0.1), head=dict(in_channels=512))
optim_wrapper = dict(clip_grad=None)
