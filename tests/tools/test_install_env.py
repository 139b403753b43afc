"""tools/install_env.sh checks what is installed, not only its own stamp."""
import os
import os.path as osp
import re
import shutil
import subprocess
import sys

import pytest

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
    assert 'mmcv ops run on the CPU' in out  # nms and roi_align


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


# --plan: how mmcv's ops would be built, decided on this CPU machine from stand-ins
# for nvcc and nvidia-smi and a stated torch CUDA version; nothing is built.
UTILITIES = ('sed', 'head', 'tr', 'grep', 'sort', 'paste', 'env', 'nproc', 'cat', 'dirname')


def plan(tmp_path, torch_cuda, nvcc=None, gpus=None, cuda_home_nvcc=None, **env):
    """Runs ``install_env.sh --plan`` on a PATH holding only the utilities it uses
    and, if given, an nvcc reporting release ``nvcc`` and an nvidia-smi listing the
    compute capabilities ``gpus`` (an empty list: no GPU found, as nvidia-smi exits
    then). ``cuda_home_nvcc``: a toolkit at $CUDA_HOME with that nvcc release.
    Returns the output and the wheel cache folder it names."""
    path = tmp_path / 'bin'
    path.mkdir()
    for name in UTILITIES:
        (path / name).symlink_to(shutil.which(name))

    def stub(folder, name, text):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text('#!/bin/sh\n' + text)
        (folder / name).chmod(0o755)
    nvcc_says = 'echo "Cuda compilation tools, release {0}, V{0}.1"\n'
    if nvcc:
        stub(path, 'nvcc', nvcc_says.format(nvcc))
    if gpus is not None:
        stub(path, 'nvidia-smi', ''.join(f'echo {cap}\n' for cap in gpus) if gpus else
             'echo "No devices were found"; exit 6\n')
    full_env = {k: v for k, v in os.environ.items() if k not in (
        'CUDA_HOME', 'TORCH_CUDA_ARCH_LIST', 'MAX_JOBS', 'FLATTEN_MM_CUDA_OPS')}
    if cuda_home_nvcc:
        stub(tmp_path / 'cuda' / 'bin', 'nvcc', nvcc_says.format(cuda_home_nvcc))
        full_env['CUDA_HOME'] = str(tmp_path / 'cuda')
    full_env.update(PATH=str(path), FLATTEN_MM_TORCH_CUDA=torch_cuda, PYTHON=sys.executable,
                    FLATTEN_MM_CACHE=str(tmp_path / 'cache'), **env)
    proc = subprocess.run([shutil.which('bash'), SCRIPT, '--plan'], env=full_env,
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    wheels = re.search(r'wheel cache: (\S+)', out).group(1)
    assert wheels.startswith(str(tmp_path / 'cache' / 'wheels') + '/'), out
    return out, osp.basename(wheels)


CPU_WHEELS = re.compile(rf"mmcv-{re.escape(pinned('MMCV_VERSION'))}-torch[^-]+-cp3\d+")


def test_plan_cpu_machine_keeps_the_cpu_wheel_folder(tmp_path):
    """This machine's case (CI): a CUDA build of torch and nvcc 13.0, no GPU. The
    wheel folder is the one CI's cached wheel has always been in."""
    out, wheels = plan(tmp_path, '13.0', nvcc='13.0', OMP_NUM_THREADS='1')
    assert 'mmcv 2.1.0 with CPU ops only: no GPU visible' in out
    assert f'FORCE_CUDA=0 CUDA_VISIBLE_DEVICES= MAX_JOBS={len(os.sched_getaffinity(0))}' in out
    assert CPU_WHEELS.fullmatch(wheels), wheels
    assert 'WARNING' not in out


def test_plan_cuda_ops_for_the_local_gpu(tmp_path):
    out, wheels = plan(tmp_path, '13.0', nvcc='13.0', gpus=['9.0'])
    assert 'mmcv 2.1.0 with CUDA ops for sm_90: the local GPUs (compute capability 9.0)' in out
    assert "FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST='9.0' MAX_JOBS=" in out
    assert re.fullmatch(r'mmcv-2\.1\.0-torch[^-]+-cuda13\.0-nvcc13\.0-sm_90-cp3\d+', wheels), wheels


@pytest.mark.parametrize('gpus, label, arch', [
    (['9.0', '9.0'], 'sm_90', '9.0'),             # each architecture once
    (['9.0', '8.0'], 'sm_80, sm_90', '8.0;9.0'),  # mixed GPUs: all of theirs
])
def test_plan_several_gpus(tmp_path, gpus, label, arch):
    out, wheels = plan(tmp_path, '13.0', nvcc='13.0', gpus=gpus)
    assert f'with CUDA ops for {label}:' in out
    assert f"TORCH_CUDA_ARCH_LIST='{arch}'" in out
    assert f"-{label.replace(', ', '_')}-cp3" in wheels


def test_plan_honours_arch_list_and_max_jobs(tmp_path):
    out, wheels = plan(tmp_path, '13.0', nvcc='13.0', gpus=['9.0'],
                       TORCH_CUDA_ARCH_LIST='8.0;9.0+PTX', MAX_JOBS='3')
    assert 'with CUDA ops for sm_80, sm_90+PTX: TORCH_CUDA_ARCH_LIST=8.0;9.0+PTX' in out
    assert "TORCH_CUDA_ARCH_LIST='8.0;9.0+PTX' MAX_JOBS=3" in out
    assert '-sm_80_sm_90+PTX-cp3' in wheels


def test_plan_arch_list_builds_cuda_ops_without_a_gpu(tmp_path):
    """For another machine's GPUs, e.g. on a build host."""
    out, _ = plan(tmp_path, '13.0', nvcc='13.0', gpus=[], TORCH_CUDA_ARCH_LIST='9.0')
    assert 'with CUDA ops for sm_90' in out


def test_plan_minor_cuda_versions_may_differ(tmp_path):
    out, wheels = plan(tmp_path, '13.0', nvcc='13.1', gpus=['9.0'])
    assert 'with CUDA ops for sm_90' in out
    assert '-cuda13.0-nvcc13.1-sm_90-' in wheels


def test_plan_prefers_cuda_home(tmp_path):
    out, _ = plan(tmp_path, '13.0', nvcc='12.8', cuda_home_nvcc='13.0', gpus=['9.0'])
    assert 'with CUDA ops for sm_90' in out
    assert f"nvcc 13.0 ({tmp_path / 'cuda' / 'bin' / 'nvcc'})" in out


@pytest.mark.parametrize('torch_cuda, nvcc, why, fix', [
    ('13.0', None, 'no CUDA toolkit: no nvcc in $CUDA_HOME/bin or on PATH',
     "the CUDA toolkit 13.0 (torch's CUDA), with nvcc on PATH"),
    ('13.0', '12.8', 'nvcc is CUDA 12.8, torch is built for CUDA 13.0',
     "the CUDA toolkit 13.0 (torch's CUDA), first on PATH"),
    ('none', '13.0', 'torch is a CPU-only build', 'a CUDA build of torch'),
])
def test_plan_gpu_without_what_cuda_ops_need(tmp_path, torch_cuda, nvcc, why, fix):
    """A GPU is there, but the CUDA ops cannot be built: CPU ops, the reason, and
    what to install, in the CPU wheel folder."""
    out, wheels = plan(tmp_path, torch_cuda, nvcc=nvcc, gpus=['9.0'])
    assert f'mmcv 2.1.0 with CPU ops only: {why}' in out
    assert 'WARNING: a GPU is here but mmcv gets no CUDA ops' in out
    assert f'for them install {fix}' in out
    assert 'FORCE_CUDA=0 CUDA_VISIBLE_DEVICES=' in out
    assert CPU_WHEELS.fullmatch(wheels), wheels


def test_plan_cuda_ops_switched_off(tmp_path):
    out, wheels = plan(tmp_path, '13.0', nvcc='13.0', gpus=['9.0'], FLATTEN_MM_CUDA_OPS='0')
    assert 'with CPU ops only: FLATTEN_MM_CUDA_OPS=0' in out
    assert 'WARNING' not in out
    assert CPU_WHEELS.fullmatch(wheels), wheels


def test_check_without_a_venv_fails(tmp_path):
    """--check of a checkout with no .venv says so instead of passing."""
    (tmp_path / 'tools').mkdir()
    shutil.copy(SCRIPT, tmp_path / 'tools')
    proc = subprocess.run(['bash', str(tmp_path / 'tools' / 'install_env.sh'), '--check'],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"ERROR: no {tmp_path / '.venv'}; run make install" in proc.stdout
