# FLatten-PVT-L on ImageNet-1K: the recipe of flatten-pvt-t_8xb128_in1k.py with the
# release's drop path (0.3) and gradient clipping (1.0) for this size.
_base_ = './flatten-pvt-t_8xb128_in1k.py'

model = dict(backbone=dict(arch='large', drop_path_rate=0.3))
optim_wrapper = dict(clip_grad=dict(_delete_=True, max_norm=1.0))
