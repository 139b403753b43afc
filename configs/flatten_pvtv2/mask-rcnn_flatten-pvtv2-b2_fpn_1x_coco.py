# Mask R-CNN + FPN with FLatten-PVTv2-B2 on COCO, 1x (PVTv2's recipe: AdamW,
# lr 2e-4, weight decay 1e-4).
# No ImageNet weights were released for FLatten-PVTv2-B2 (only B0): pretrain
# them with flatten-pvtv2-b2_8xb128_in1k.py (see docs/pretraining.md) and point init_cfg
# at the result.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='FLattenPVTv2',
        arch='b2',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=None),
    neck=dict(in_channels=[64, 128, 320, 512]))

optim_wrapper = dict(
    optimizer=dict(_delete_=True, type='AdamW', lr=2e-4, weight_decay=1e-4),
    paramwise_cfg=dict(custom_keys={
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}))
