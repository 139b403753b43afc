# UperNet with FLatten-Swin-T on ADE20K, 160k iterations, 8 GPUs x 2 images
# (Swin's recipe: AdamW, lr 6e-5, weight decay 0.01, linear warm-up, poly decay).
_base_ = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

pretrained = 'checkpoints/flatten_swin_tiny.pth'  # released FLatten-Swin-T weights
model = dict(
    backbone=dict(
        _delete_=True,
        type='FLattenSwin',
        arch='tiny',
        attn_type='LLSS',
        window_size=7,
        linear_window=None,  # global focused linear attention, as pretrained
        drop_path_rate=0.3,
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    decode_head=dict(in_channels=[96, 192, 384, 768], num_classes=150),
    auxiliary_head=dict(in_channels=384, num_classes=150))

optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={
        'relative_position_bias_table': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}))
