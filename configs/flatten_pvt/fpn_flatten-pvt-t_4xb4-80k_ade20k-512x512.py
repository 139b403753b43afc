# Semantic FPN with FLatten-PVT-T on ADE20K, 80k iterations, 4 GPUs x 4 images
# (PVT's recipe: AdamW, lr 1e-4, weight decay 1e-4, poly decay with power 0.9).
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_80k.py',
]
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

crop_size = (512, 512)
pretrained = 'checkpoints/flatten_pvt_tiny.pth'  # released FLatten-PVT-T weights
model = dict(
    data_preprocessor=dict(size=crop_size),
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='FLattenPVT',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 320, 512], out_channels=256, num_outs=4),
    decode_head=dict(num_classes=150))

train_dataloader = dict(batch_size=4)
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, weight_decay=1e-4),
    paramwise_cfg=dict(custom_keys={
        'pos_embed': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}),
    clip_grad=None)
param_scheduler = [
    dict(type='PolyLR', power=0.9, eta_min=0.0, by_epoch=False, begin=0, end=80000),
]
