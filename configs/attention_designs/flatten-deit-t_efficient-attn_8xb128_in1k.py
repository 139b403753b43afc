# FLatten-DeiT-T on ImageNet-1K with the 'efficient' attention design; everything
# else is flatten-deit-t_8xb128_in1k.py (the paper's comparison of linear
# attention modules on DeiT-T). See README.md.
_base_ = '../flatten_deit/flatten-deit-t_8xb128_in1k.py'

model = dict(backbone=dict(attn_design='efficient'))
