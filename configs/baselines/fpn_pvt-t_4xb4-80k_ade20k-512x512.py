# Softmax baseline for fpn_flatten-pvt-t_4xb4-80k_ade20k-512x512.py: the same
# segmenter and recipe with PVT-T (mmseg has no PVT backbone; mmdet's is used).
_base_ = '../flatten_pvt/fpn_flatten-pvt-t_4xb4-80k_ade20k-512x512.py'
model = dict(
    backbone=dict(
        _delete_=True,
        type='mmdet.PyramidVisionTransformer',
        num_layers=[2, 2, 2, 2],
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/pvt_tiny.pth')))
