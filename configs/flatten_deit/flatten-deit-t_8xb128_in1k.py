# FLatten-DeiT-T on ImageNet-1K with mmpretrain, on DeiT's recipe (mmpretrain's
# deit-tiny_4xb256_in1k.py): 300 epochs, batch 1024 (8 GPUs x 128), AdamW (lr 1e-3,
# i.e. 5e-4 per 512 images, weight decay 0.05), 20 warm-up epochs, cosine decay,
# gradient clipping 5.0, label smoothing 0.1, Mixup 0.8 / CutMix 1.0, RandAugment,
# random erasing; drop path 0.1 as DeiT. The class token is classified by a linear
# head after the final norm. Norms, biases, the class token, the position
# embedding, the positional encodings and the focusing scale take no weight decay.
_base_ = 'mmpretrain::deit/deit-tiny_4xb256_in1k.py'
custom_imports = dict(imports=['flatten_mm'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='FLattenDeiT',
        arch='tiny',
        attn_type='L',  # focused linear attention in every block
        final_norm=True,
        out_type='cls_token',
        out_indices=(11, ),
        drop_path_rate=0.1),
    head=dict(
        _delete_=True,
        type='LinearClsHead',
        num_classes=1000,
        in_channels=192,
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),
        init_cfg=dict(type='TruncNormal', layer='Linear', std=.02, bias=0.),
        cal_acc=False))

train_dataloader = dict(batch_size=128)
val_dataloader = dict(batch_size=128)
test_dataloader = val_dataloader

optim_wrapper = dict(
    paramwise_cfg=dict(
        flat_decay_mult=0.0,
        custom_keys={
            '.cls_token': dict(decay_mult=0.0),
            '.pos_embed': dict(decay_mult=0.0),
            'positional_encoding': dict(decay_mult=0.0),
            '.scale': dict(decay_mult=0.0)}))
