# UperNet with FLatten-CSwin-T on ADE20K, 160k iterations, 8 GPUs x 2 images
# (mmseg's Swin-T UperNet recipe, which CSWin's segmentation recipe follows:
# AdamW, lr 6e-5, weight decay 0.01, linear warm-up, poly decay).
_base_ = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

pretrained = 'checkpoints/flatten_cswin_tiny.pth'  # released FLatten-CSwin-T weights
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
    decode_head=dict(in_channels=[64, 128, 256, 512], num_classes=150),
    auxiliary_head=dict(in_channels=256, num_classes=150))

optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}))
