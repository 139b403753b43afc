# Mask R-CNN + FPN with FLatten-PVT-M on COCO, 1x.
# No ImageNet weights were released for FLatten-PVT-M: pretrain them with
# flatten-pvt-m_8xb128_in1k.py (see docs/pretraining.md) and point init_cfg at the result.
_base_ = './mask-rcnn_flatten-pvt-t_fpn_1x_coco.py'
model = dict(backbone=dict(arch='medium', init_cfg=None))
