# FLatten-PVTv2-B5 on ImageNet-1K: the recipe of flatten-pvtv2-b0_8xb128_in1k.py with
# drop path 0.3 and gradient clipping 1.0 as the release's B4 (it gives no B5 recipe).
_base_ = './flatten-pvtv2-b0_8xb128_in1k.py'

model = dict(backbone=dict(arch='b5', drop_path_rate=0.3), head=dict(in_channels=512))
optim_wrapper = dict(clip_grad=dict(_delete_=True, max_norm=1.0))
