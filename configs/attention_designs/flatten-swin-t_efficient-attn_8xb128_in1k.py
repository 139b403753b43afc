# FLatten-Swin-T on ImageNet-1K with the 'efficient' attention design in the linear
# stages; everything else is flatten-swin-t_8xb128_in1k.py (the paper's
# comparison of linear attention modules on Swin-T). See README.md.
_base_ = '../flatten_swin/flatten-swin-t_8xb128_in1k.py'

model = dict(backbone=dict(attn_design='efficient'))
