# RetinaNet + FPN with FLatten-PVT-S on COCO, 1x.
# No ImageNet weights were released for FLatten-PVT-S: pretrain them with timm
# (flatten_pvt_small, see the README) and point init_cfg at the file.
_base_ = './retinanet_flatten-pvt-t_fpn_1x_coco.py'
model = dict(backbone=dict(arch='small', init_cfg=None))
