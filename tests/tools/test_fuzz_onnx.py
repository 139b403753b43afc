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
    assert fuzz_onnx.main(['--cases', '4', '--seed', '2']) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith('4 cases, 0 failed, ')


def test_a_graph_held_at_its_export_size_is_caught(monkeypatch, capsys):
    """With the ONNX trace taken for a plain jit trace (the traced size's
    shortcuts, and ``only_at_traced_size``'s stop), every PVTv2 case fails:
    its graph stops at the other sizes, which only Swin's one-window check may."""
    from flatten_mm.models import utils
    monkeypatch.setattr(utils, 'onnx_export_trace', lambda: False)
    assert fuzz_onnx.main(['--cases', '2', '--seed', '2', '--families', 'pvtv2']) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith('2 cases, 2 failed, 0 runs stopped'), out[-1]
    assert all('stopped: ' in line for line in out[:-1]), out
