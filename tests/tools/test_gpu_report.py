"""tools/analysis_tools/gpu_report.sh: its parts, its pins, and a part run on the CPU."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / 'tools' / 'analysis_tools' / 'gpu_report.sh'
TEXT = SCRIPT.read_text()


def run_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, 'PYTHON': sys.executable, **env}
    return subprocess.run(['bash', str(SCRIPT), *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


def test_every_part_listed_has_a_function_and_every_function_is_listed():
    listed = re.search(r'^PARTS=\(([^)]*)\)', TEXT, re.M).group(1).split()
    defined = re.findall(r'^part_(\w+)\(\)', TEXT, re.M)
    assert listed == defined
    assert {'tests', 'core', 'bb', 'kernels', 'bbc', 'timm', 'compile'} <= set(listed)


def test_pinned_versions_come_from_install_env():
    install = (ROOT / 'tools' / 'install_env.sh').read_text()
    names = set(re.findall(r'\$\(pin (\w+)\)', TEXT))
    assert names == {'MMENGINE', 'MMDET', 'MMSEG', 'PYCOCOTOOLS', 'MMCV'}
    for name in names:
        assert re.search(rf'^{name}_VERSION=\d', install, re.M), name


def test_unknown_part_is_refused_naming_the_parts(tmp_path):
    result = run_script('run', str(tmp_path), 'env', 'benchmark')
    assert result.returncode == 2
    assert "unknown part 'benchmark'" in result.stderr
    assert 'env tests fuzz core bb kernels bound bbc prof timm compile sweep' in result.stderr
    assert not (tmp_path / 'env.log').exists()  # nothing ran


def test_env_part_runs_on_the_cpu(tmp_path):
    result = run_script('run', str(tmp_path), 'env', FLATTEN_MM_REPORT_DEVICE='cpu')
    assert result.returncode == 0, result.stderr
    header, line = (tmp_path / 'summary.txt').read_text().splitlines()
    assert header.startswith('# ') and header.endswith('on cpu: env')
    assert line.split()[:2] == ['env', 'rc=0']
    log = (tmp_path / 'env.log').read_text()
    import torch
    assert f'torch {torch.__version__}' in log and 'device cpu' in log


def test_a_failed_part_fails_the_run_and_the_next_part_still_runs(tmp_path):
    result = run_script('run', str(tmp_path), 'env', 'env', PYTHON='false',
                        FLATTEN_MM_REPORT_DEVICE='cpu')
    assert result.returncode == 1
    lines = (tmp_path / 'summary.txt').read_text().splitlines()[1:]
    assert [line.split()[:2] for line in lines] == [['env', 'rc=1']] * 2


def test_without_a_command_the_whole_header_is_the_usage():
    result = run_script()
    assert result.returncode == 2
    assert 'gpu_report.sh wheels DIR' in result.stderr and 'run OUT PART' in result.stderr
    assert result.stderr.rstrip().splitlines()[-1].startswith('# Parts: env tests')
