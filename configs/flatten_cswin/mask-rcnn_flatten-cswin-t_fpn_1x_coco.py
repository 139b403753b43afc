# Mask R-CNN + FPN with FLatten-CSwin-T on COCO, 1x (mmdet's Swin-T recipe,
# which CSWin's detection recipe follows: AdamW, lr 1e-4, weight decay 0.05,
# no decay on norms and position parameters).
_base_ = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

# The released FLatten-CSwin-T ImageNet-1K checkpoint ({'model': state_dict}).
pretrained = 'checkpoints/flatten_cswin_tiny.pth'
model = dict(
    backbone=dict(
        _delete_=True,
        type='FLattenCSwin',
        arch='tiny',
        attn_type='LLSS',  # global focused linear stages 1-2, as pretrained
        split_size=(1, 2, 7, 7),
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[64, 128, 256, 512]))

optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}))
