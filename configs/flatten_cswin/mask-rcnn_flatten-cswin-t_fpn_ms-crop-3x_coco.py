# Mask R-CNN + FPN with FLatten-CSwin-T on COCO, 3x with multi-scale training
# and random crops (mmdet's Swin-T 3x recipe).
_base_ = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py'
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

pretrained = 'checkpoints/flatten_cswin_tiny.pth'  # released FLatten-CSwin-T weights
model = dict(
    backbone=dict(
        _delete_=True,
        type='FLattenCSwin',
        arch='tiny',
        attn_type='LLSS',
        split_size=(1, 2, 7, 7),
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 256, 512]))

optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}))
