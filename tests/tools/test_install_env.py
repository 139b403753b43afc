"""tools/install_env.sh checks what is installed, not only its own stamp."""
import os
import os.path as osp
import subprocess

from demo_runs import ROOT

SCRIPT = osp.join(ROOT, 'tools', 'install_env.sh')


def pinned(name):
    for line in open(SCRIPT):
        if line.startswith(f'{name}='):
            return line.split('=')[1].split()[0]
    raise AssertionError(f'{name} is not set in {SCRIPT}')


def check(extra_path=None):
    env = dict(os.environ)
    if extra_path:
        env['PYTHONPATH'] = str(extra_path)
    proc = subprocess.run(['bash', SCRIPT, '--check'], env=env, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def fake_distribution(root, name, version):
    info = root / f'{name}-{version}.dist-info'
    info.mkdir(parents=True)
    (info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')


def test_check_passes_on_this_environment():
    rc, out = check()
    assert rc == 0, out
    assert 'every pinned package has its pinned version' in out


def test_check_names_a_replaced_torch(tmp_path):
    """The case met in practice: pip swapped torch 2.14.1 for 2.12.1 while the
    stamp still matched. A distribution shadowing the installed one stands
    in for it here."""
    torch_pin = pinned('TORCH_VERSION')
    assert torch_pin != '2.12.1'
    fake_distribution(tmp_path, 'torch', '2.12.1')
    fake_distribution(tmp_path, 'timm', '0.9.0')
    rc, out = check(tmp_path)
    assert rc == 1, out
    assert f'ERROR: torch is 2.12.1, but {torch_pin} is pinned' in out
    assert f"ERROR: timm is 0.9.0, but {pinned('TIMM_VERSION')} is pinned" in out
    assert 'make clean-venv && make install' in out
    assert 'numpy' not in out  # only what does not hold is named
