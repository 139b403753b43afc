# UperNet with FLatten-Swin-T on ADE20K, 160k iterations, with the 'focused'
# attention design (FLatten's own; the released ImageNet weights, as the
# parent config); everything else is
# upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py. See README.md.
_base_ = '../flatten_swin/upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py'

model = dict(backbone=dict(attn_design='focused'))
