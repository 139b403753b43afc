# Softmax baseline for the detection demo: the same detector, data and recipe
# with mmdet's PVT-T (spatial-reduction softmax attention), from scratch.
_base_ = './mask-rcnn_flatten-pvt-t_fpn_shapes.py'
model = dict(
    backbone=dict(
        _delete_=True,
        type='PyramidVisionTransformer',
        num_layers=[2, 2, 2, 2],
        init_cfg=None))
