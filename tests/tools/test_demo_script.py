"""`make demo`'s script (tools/demo.sh) on tiny data with two iterations per
run: both runs train side by side, are evaluated, draw their predictions, and
the script ends with the two result lines."""
import os
import os.path as osp
import re
import signal
import subprocess
import sys
import time

import pytest

from demo_runs import ROOT, run


@pytest.mark.heavy(31)
def test_demo_script_prints_both_result_lines(shapes, tmp_path):
    work = str(tmp_path / 'demo')
    env = dict(DEMO_DATA=shapes, MAX_ITERS_DET='2', MAX_ITERS_SEG='2', PY=sys.executable,
               DEMO_PROGRESS_EVERY='1')
    out = run('bash', osp.join(ROOT, 'tools/demo.sh'), work, cwd=ROOT, env=env, python=False)
    lines = out.strip().splitlines()
    assert re.fullmatch(r'demo detection bbox_mAP=\d\.\d{3} segm_mAP=\d\.\d{3}', lines[-2]), out
    assert re.fullmatch(r'demo segmentation mIoU=\d+\.\d{2}', lines[-1]), out
    for name in ('det', 'seg'):
        assert re.search(rf'\[demo\] {name} done after \d+ s: 2 iterations, '
                         r'median (n/a|\d+\.\d\d s) per iteration', out), out
        pics = [f for d, _, fs in os.walk(osp.join(work, name)) if 'pictures' in d
                for f in fs if f.endswith(('.jpg', '.png'))]
        assert len(pics) == 6, (name, pics)
        # progress while it runs: a status line per run every DEMO_PROGRESS_EVERY seconds
        assert re.search(rf'\[demo\] {name}: (starting|evaluating|iteration \d+/\d+, '
                         rf'loss [\d.]+, eta [\d:]+) \(\d+ s\)', out), out
    # the end names where the pictures are
    done = next(line for line in lines if line.startswith('[demo] done in'))
    assert osp.join(work, 'det') in done and osp.join(work, 'seg') in done, done


@pytest.mark.heavy(21)
def test_demo_script_stops_both_runs_on_ctrl_c(shapes, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) stops both training
    runs, not only the script, and says where the logs are."""
    work = str(tmp_path / 'demo')
    env = dict(os.environ, DEMO_DATA=shapes, MAX_ITERS_DET='100000', MAX_ITERS_SEG='100000',
               PY=sys.executable, DEMO_PROGRESS_EVERY='1')
    # the script starts as from a terminal, with SIGINT at its default: a shell
    # that inherits SIGINT ignored (e.g. tests run as a background job) cannot trap it
    proc = subprocess.Popen(['bash', osp.join(ROOT, 'tools/demo.sh'), work], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not all(
                osp.exists(osp.join(work, f'{n}.train.log')) and
                'Iter(train)' in open(osp.join(work, f'{n}.train.log')).read()
                for n in ('det', 'seg')):
            time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert f'[demo] stopped; logs so far: {work}/{{det,seg}}.train.log' in out, out
        time.sleep(1)
        left = subprocess.run(['pgrep', '-f', work], capture_output=True, text=True).stdout
        assert left == '', f'processes still running: {left}'
    finally:  # whatever failed, no training is left running
        subprocess.run(['pkill', '-KILL', '-f', work])
