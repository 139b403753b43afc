"""tools/analysis_tools/fuzz_onnx.py: random exports with dynamic axes equal
eager at other sizes, and a graph held at its export size is caught."""
import os.path as osp
import sys

import pytest

from demo_runs import ROOT

sys.path.insert(0, osp.join(ROOT, 'tools/analysis_tools'))
import fuzz_onnx  # noqa: E402

pytest.importorskip('onnxruntime')


def test_random_exports_equal_eager(capsys):
    """Four cases (PVT, two DeiT, PVTv2), twelve runs, none stopped: each
    compared with eager."""
    assert fuzz_onnx.main(['--cases', '4', '--seed', '2']) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith('4 cases, 0 failed, 0 runs ')


def test_swin_may_stop_only_where_a_stage_changes_branch():
    """Window 7 (S stages; L global): 64x72 fits stages 3 and 4 (4x5, 2x3), as
    does 112x112; 128x160 does not fit stage 3 (8x10)."""
    kw = dict(attn_type='LLSS', window_size=7)
    assert fuzz_onnx.swin_branches(kw, (64, 72)) == (None, None, True, True)
    assert fuzz_onnx.swin_branches(kw, (112, 112)) == fuzz_onnx.swin_branches(kw, (64, 72))
    assert fuzz_onnx.swin_branches(kw, (128, 160)) == (None, None, False, True)
    assert fuzz_onnx.swin_branches(dict(kw, linear_window=5), (64, 72))[:2] == (False, False)


def test_a_dropped_positional_encoding_is_caught(monkeypatch, capsys):
    """The positional encodings' add left out of the exported graph (as
    torch.onnx dropped it, an add into a view) fails the case whose layers
    have one (the one with a linear stage): parameters that start at zero are
    drawn at random first."""
    from flatten_mm.models import attention
    from flatten_mm.models.utils import onnx_export_trace
    add = attention.add_resized_to_block_
    monkeypatch.setattr(attention, 'add_resized_to_block_',
                        lambda x, *args: x if onnx_export_trace() else add(x, *args))
    assert fuzz_onnx.main(['--cases', '2', '--seed', '2', '--families', 'pvtv2']) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith('2 cases, 1 failed'), out[-1]
    assert out[0].startswith('case 0 ') and "'attn_type': 'SLSS'" in out[0]  # (1: SSSS)


def test_a_graph_held_at_its_export_size_is_caught(monkeypatch, capsys):
    """With ``utils``' own calls taking the ONNX trace for a plain jit trace
    (``only_at_traced_size``'s stop at other sizes), every PVTv2 case fails:
    its graph stops, which only Swin's one-window check may."""
    from flatten_mm.models import utils
    monkeypatch.setattr(utils, 'onnx_export_trace', lambda: False)
    assert fuzz_onnx.main(['--cases', '2', '--seed', '2', '--families', 'pvtv2']) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith('2 cases, 2 failed, 0 runs stopped'), out[-1]
    assert all('stopped: ' in line for line in out[:-1]), out
