# FLatten-CSwin-B on ImageNet-1K: flatten-cswin-t_8xb128_in1k.py with the release's
# drop path 0.5 and weight decay 0.1 for this size.
_base_ = './flatten-cswin-t_8xb128_in1k.py'

model = dict(backbone=dict(arch='base', drop_path_rate=0.5), head=dict(in_channels=768))
optim_wrapper = dict(optimizer=dict(weight_decay=0.1))
