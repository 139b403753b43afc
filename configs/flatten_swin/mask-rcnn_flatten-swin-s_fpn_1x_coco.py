# Mask R-CNN + FPN with FLatten-Swin-S on COCO, 1x.
_base_ = './mask-rcnn_flatten-swin-t_fpn_1x_coco.py'
pretrained = 'checkpoints/flatten_swin_small.pth'  # released FLatten-Swin-S weights
model = dict(
    backbone=dict(arch='small', drop_path_rate=0.3,
                  init_cfg=dict(type='Pretrained', checkpoint=pretrained)))
