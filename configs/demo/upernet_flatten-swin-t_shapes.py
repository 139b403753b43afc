# UperNet with a FLatten-Swin-T backbone on the built-in shapes data. Same model
# code as the ADE20K config; the data, schedule, image size and head width are
# cut for 2 CPU cores (exercised by the tests; `make demo` trains the other two).
_base_ = './fpn_flatten-pvt-t_shapes.py'

norm_cfg = dict(type='GN', num_groups=16, requires_grad=True)
head_dims = 64
model = dict(
    type='EncoderDecoder',
    backbone=dict(
        _delete_=True,
        type='FLattenSwin',
        arch='tiny',
        attn_type='LLSS',
        window_size=7,
        linear_window=None,
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        init_cfg=None),
    neck=None,
    decode_head=dict(
        _delete_=True,
        type='UPerHead',
        in_channels=[96, 192, 384, 768],
        in_index=[0, 1, 2, 3],
        pool_scales=(1, 2, 3, 6),
        channels=head_dims,
        dropout_ratio=0.0,
        num_classes=4,
        norm_cfg=norm_cfg,
        align_corners=False,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={
    'relative_position_bias_table': dict(decay_mult=0.),
    'positional_encoding': dict(decay_mult=0.),
    'norm': dict(decay_mult=0.)}))
