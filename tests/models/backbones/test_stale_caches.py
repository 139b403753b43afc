"""Inference caches never serve values made from old weights (issue 23):
weights changed in place through ``.data`` (mmdet's MeanTeacherHook, mmengine's
EMAHook swap), loaded, or cast, give the outputs of a fresh model with the
same weights."""
import copy

import pytest
import torch

from flatten_mm.models.backbones import FLattenSwin

from backbone_checks import FAMILIES, small_backbone


def fresh_outputs(model, x):
    """Outputs of a new model of the same config holding ``model``'s weights."""
    fresh = copy.deepcopy(model)
    for m in fresh.modules():
        m.__dict__.pop('_tensor_cache', None)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        return fresh.eval()(x)


def assert_same(outs, refs):
    for a, b in zip(outs, refs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_issue_reproduction():
    torch.manual_seed(0)
    student = FLattenSwin(depths=[1, 1, 2, 1])
    student.init_weights()
    teacher = copy.deepcopy(student).eval()
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        teacher(x)  # fills the cache
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        for t, s in zip(teacher.parameters(), student.parameters()):
            t.data.mul_(0.5).add_(s.data, alpha=0.5)  # MeanTeacherHook's update
        fresh = FLattenSwin(depths=[1, 1, 2, 1]).eval()
        fresh.load_state_dict(teacher.state_dict())
        assert_same(teacher(x), fresh(x))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')


# on CPUs parameter-derived values are cached and checked against a copy of
# the parameters; on CUDA they are made every call
@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=CUDA)])
@pytest.mark.parametrize('family', FAMILIES)
def test_mean_teacher_update_through_data(family, device):
    student = small_backbone(family).to(device)
    teacher = copy.deepcopy(student).eval()
    x = torch.randn(1, 3, 45, 67, device=device)
    with torch.no_grad():
        teacher(x)
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        for _ in range(2):  # two updates, a forward between them
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.data.mul_(0.5).add_(s.data, alpha=0.5)
            outs = teacher(x)
            assert_same(outs, fresh_outputs(teacher, x))


@pytest.mark.parametrize('family', FAMILIES)
def test_ema_swap_load_and_cast(family):
    """mmengine's EMAHook swaps the EMA and the model weights with
    ``.data.copy_`` around validation; load_state_dict and ``.to()`` too."""
    model = small_backbone(family).eval()
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(1, 3, 45, 67)
    with torch.no_grad():
        before = model(x)
        for p, q in zip(model.parameters(), ema.parameters()):  # EMAHook.before_val_epoch
            tmp = p.data.clone()
            p.data.copy_(q.data)
            q.data.copy_(tmp)
        assert_same(model(x), fresh_outputs(model, x))
        for p, q in zip(model.parameters(), ema.parameters()):  # and back after it
            tmp = p.data.clone()
            p.data.copy_(q.data)
            q.data.copy_(tmp)
        assert_same(model(x), before)
        model.load_state_dict(ema.state_dict())
        assert_same(model(x), fresh_outputs(model, x))
        model.to(torch.float64)
        outs = model(x.double())
        assert all(o.dtype == torch.float64 for o in outs)
        assert_same(outs, fresh_outputs(model, x.double()))


def test_nan_parameters_are_never_served_from_the_cache():
    """torch.equal(nan, nan) is False: a parameter holding NaN is remade
    every call (the same outputs), never compared equal to a stale copy."""
    model = small_backbone('swin').eval()
    x = torch.randn(1, 3, 45, 67)
    with torch.no_grad():
        model(x)
        table = model.layers[2].blocks[0].attn.relative_position_bias_table
        table.data[0, 0] = float('nan')
        first = model(x)
        table.data[0, 0] = 0.5
        assert_same(model(x), fresh_outputs(model, x))
    assert any(torch.isnan(o).any() for o in first)


@pytest.mark.parametrize('family', FAMILIES)
def test_mmdet_mean_teacher_loop(family):
    """mmdet's semi-supervised loop: the runner's model.train() each step
    (the teacher included, though it never runs in training mode), the
    student's step, MeanTeacherHook's in-place update, then the teacher in
    eval under no_grad for pseudo-labels (SemiBaseDetector.get_pseudo_instances).
    The teacher never forwards in training mode: its cached encodings stay,
    checked against its weights on every use."""
    hooks = pytest.importorskip('mmdet.engine.hooks')
    student = small_backbone(family, drop_path_rate=0.)
    model = torch.nn.Module()
    model.student, model.teacher = student, copy.deepcopy(student)
    hook = hooks.MeanTeacherHook(momentum=0.5)
    optim = torch.optim.SGD(student.parameters(), lr=1.0)
    x = torch.randn(1, 3, 45, 67)
    for _ in range(3):
        model.train()
        optim.zero_grad()
        sum(o.square().mean() for o in student(x)).backward()
        optim.step()
        hook.momentum_update(model, hook.momentum)
        model.teacher.eval()
        with torch.no_grad():
            assert_same(model.teacher(x), fresh_outputs(model.teacher, x))
