# Softmax baseline for mask-rcnn_flatten-pvt-t_fpn_1x_coco.py: the same detector
# and recipe with mmdet's PVT-T (spatial-reduction softmax attention). mmdet
# ships RetinaNet but no Mask R-CNN config for PVT.
_base_ = '../flatten_pvt/mask-rcnn_flatten-pvt-t_fpn_1x_coco.py'
model = dict(
    backbone=dict(
        _delete_=True,
        type='PyramidVisionTransformer',
        num_layers=[2, 2, 2, 2],
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/pvt_tiny.pth')))
