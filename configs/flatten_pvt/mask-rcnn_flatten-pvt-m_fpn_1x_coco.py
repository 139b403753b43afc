# Mask R-CNN + FPN with FLatten-PVT-M on COCO, 1x.
# No ImageNet weights were released for FLatten-PVT-M: pretrain them with timm
# (model name flatten_pvt_medium, see the README) and point init_cfg at the file.
_base_ = './mask-rcnn_flatten-pvt-t_fpn_1x_coco.py'
model = dict(backbone=dict(arch='medium', init_cfg=None))
