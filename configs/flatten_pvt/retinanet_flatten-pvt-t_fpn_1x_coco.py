# RetinaNet + FPN with FLatten-PVT-T on COCO, 1x (PVT's recipe: AdamW, lr 1e-4,
# weight decay 1e-4, 8 GPUs x 2 images).
_base_ = [
    'mmdet::_base_/models/retinanet_r50_fpn.py',
    'mmdet::_base_/datasets/coco_detection.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

pretrained = 'checkpoints/flatten_pvt_tiny.pth'  # released FLatten-PVT-T weights
model = dict(
    backbone=dict(
        _delete_=True,
        type='FLattenPVT',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 320, 512]))

optim_wrapper = dict(
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, weight_decay=1e-4),
    paramwise_cfg=dict(custom_keys={
        'pos_embed': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}))
