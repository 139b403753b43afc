# Semantic FPN with FLatten-PVT-M on ADE20K. No ImageNet weights were released
# for FLatten-PVT-M: pretrain them with flatten-pvt-m_8xb128_in1k.py (see
# docs/pretraining.md) and point init_cfg at the result.
_base_ = './fpn_flatten-pvt-t_4xb4-80k_ade20k-512x512.py'
model = dict(backbone=dict(arch='medium', init_cfg=None))
