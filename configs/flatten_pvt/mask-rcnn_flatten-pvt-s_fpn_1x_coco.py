# Mask R-CNN + FPN with FLatten-PVT-S on COCO, 1x.
# No ImageNet weights were released for FLatten-PVT-S: pretrain them with timm
# (model name flatten_pvt_small, see the README) and point init_cfg at the file.
_base_ = './mask-rcnn_flatten-pvt-t_fpn_1x_coco.py'
model = dict(backbone=dict(arch='small', init_cfg=None))
