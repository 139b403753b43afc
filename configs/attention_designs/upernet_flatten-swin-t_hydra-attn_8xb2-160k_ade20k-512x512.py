# UperNet with FLatten-Swin-T on ADE20K, 160k iterations, with the 'hydra'
# attention design; everything else is
# upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py. See README.md.
_base_ = '../flatten_swin/upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py'

# ImageNet weights of the same design, the last checkpoint of
# flatten-swin-t_hydra-attn_8xb128_in1k.py (the released weights are the
# focused design's; the backbone loads mmpretrain checkpoints as they are)
pretrained = 'work_dirs/flatten-swin-t_hydra-attn_8xb128_in1k/epoch_300.pth'
model = dict(backbone=dict(attn_design='hydra', init_cfg=dict(checkpoint=pretrained)))
