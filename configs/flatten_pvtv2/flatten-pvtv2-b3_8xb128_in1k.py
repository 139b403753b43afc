# FLatten-PVTv2-B3 on ImageNet-1K: the recipe of flatten-pvtv2-b0_8xb128_in1k.py with
# the release's drop path (0.3) and gradient clipping (1.0) for this size.
_base_ = './flatten-pvtv2-b0_8xb128_in1k.py'

model = dict(backbone=dict(arch='b3', drop_path_rate=0.3), head=dict(in_channels=512))
optim_wrapper = dict(clip_grad=dict(_delete_=True, max_norm=1.0))
