# Mask R-CNN + FPN with FLatten-Swin-T on COCO, 1x (Swin's recipe: AdamW,
# lr 1e-4, weight decay 0.05, no decay on norms and position parameters).
_base_ = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

# The released FLatten-Swin-T ImageNet-1K checkpoint ({'model': state_dict}).
pretrained = 'checkpoints/flatten_swin_tiny.pth'
model = dict(
    backbone=dict(
        _delete_=True,
        type='FLattenSwin',
        arch='tiny',
        attn_type='LLSS',
        window_size=7,
        linear_window=None,  # global focused linear attention, as pretrained
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[96, 192, 384, 768]))

optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={
        'relative_position_bias_table': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}))
