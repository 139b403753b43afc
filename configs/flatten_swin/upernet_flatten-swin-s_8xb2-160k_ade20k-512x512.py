# UperNet with FLatten-Swin-S on ADE20K, 160k iterations.
_base_ = './upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py'
pretrained = 'checkpoints/flatten_swin_small.pth'  # released FLatten-Swin-S weights
model = dict(
    backbone=dict(arch='small', init_cfg=dict(type='Pretrained', checkpoint=pretrained)))
