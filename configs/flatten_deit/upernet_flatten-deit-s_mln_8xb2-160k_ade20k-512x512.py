# UperNet with FLatten-DeiT-S on ADE20K, 160k iterations, 8 GPUs x 2 images: the
# recipe of mmseg's DeiT-S UperNet (AdamW, lr 6e-5, weight decay 0.01, linear
# warm-up for 1500 iterations, poly decay). The outputs of blocks 3, 6, 9 and 12
# (stride 16) go through a multi-level neck (rescaled by 4, 2, 1 and 0.5, i.e.
# strides 4 to 32) into UperNet. The position embedding and the layers'
# positional encodings, learnt at 224 (14 x 14), are resized to each input's grid.
_base_ = 'mmseg::vit/vit_deit-s16_mln_upernet_8xb2-160k_ade20k-512x512.py'
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

# FLatten-DeiT-S pretrained on ImageNet-1K with flatten-deit-s_8xb128_in1k.py (no
# released weights: the authors published none); a timm or mmpretrain checkpoint
pretrained = 'checkpoints/flatten_deit_small.pth'
model = dict(
    pretrained=None,
    backbone=dict(
        _delete_=True,
        type='FLattenDeiT',
        arch='small',
        attn_type='L',
        pretrain_img_size=224,
        with_cls_token=True,
        final_norm=False,
        out_indices=(2, 5, 8, 11),
        drop_path_rate=0.1,
        init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=[384, 384, 384, 384], out_channels=384, scales=[4, 2, 1, 0.5]),
    decode_head=dict(in_channels=[384, 384, 384, 384], num_classes=150),
    auxiliary_head=dict(in_channels=384, num_classes=150))

optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={
        'pos_embed': dict(decay_mult=0.),
        'cls_token': dict(decay_mult=0.),
        'positional_encoding': dict(decay_mult=0.),
        '.scale': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.)}))
