"""Training that does not lose work: resume after a kill, distributed runs on
CPUs (gloo), and the upstream mmdet / mmseg training scripts on our configs."""
import glob
import os
import os.path as osp
import re
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch

from demo_runs import ROOT, det_options, losses, run, seg_options
from flatten_mm import load_checkpoint_file

SEG = osp.join(ROOT, 'configs/demo/fpn_flatten-pvt-t_shapes.py')
DET = osp.join(ROOT, 'configs/demo/mask-rcnn_flatten-pvt-t_fpn_shapes.py')
TRAIN = osp.join(ROOT, 'tools/train.py')


def weights(path):
    return load_checkpoint_file(path)['state_dict']


def assert_same_weights(a, b, atol):
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, f'largest weight difference {worst:.3g} > {atol}'
    return worst


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.heavy(37)
def test_resume_after_kill_matches_uninterrupted_run(shapes, tmp_path):
    """Kill a run right after its first checkpoint, resume it: the final
    weights and mIoU equal the uninterrupted run's exactly (same ops on the
    same CPU, and the random flips and drop-path masks continue where they
    stopped). Without RandomStateHook the drop-path masks after the resume
    differ and so do the weights."""
    iters = 12
    opts = seg_options(shapes, iters) + [
        'train_dataloader.batch_size=2', 'default_hooks.checkpoint.interval=4',
        'default_hooks.checkpoint.max_keep_ckpts=10',
        'model.backbone.drop_path_rate=0.2']  # the model draws random numbers too
    whole = str(tmp_path / 'whole')
    log_whole = run(TRAIN, SEG, '--work-dir', whole, *opts, cwd=ROOT)

    parts = str(tmp_path / 'parts')
    env = dict(os.environ, PYTHONWARNINGS='ignore')
    proc = subprocess.Popen([sys.executable, TRAIN, SEG, '--work-dir', parts, *opts],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not osp.exists(osp.join(parts, 'last_checkpoint')) and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, 'the run ended before it could be killed'
    saved = sorted(int(re.search(r'iter_(\d+)', p).group(1))
                   for p in glob.glob(osp.join(parts, 'iter_*.pth')))
    assert saved and saved[-1] < iters

    log_resumed = run(TRAIN, SEG, '--work-dir', parts, '--resume', *opts, cwd=ROOT)
    assert f'resumed epoch: 0, iter: {saved[-1]}' in log_resumed
    assert len(losses(log_resumed)) == iters - saved[-1]
    assert losses(log_resumed) == losses(log_whole)[saved[-1]:]
    assert_same_weights(weights(osp.join(whole, f'iter_{iters}.pth')),
                        weights(osp.join(parts, f'iter_{iters}.pth')), atol=0.0)
    miou = [re.findall(r'mIoU: ([0-9.]+)', log)[-1] for log in (log_whole, log_resumed)]
    assert miou[0] == miou[1]


def test_checkpoint_holds_random_state_and_loads_with_mmengine(shapes, tmp_path):
    """Our checkpoints load through mmengine's own loader under torch's
    weights-only default (the plugin's fix), random state included."""
    from mmengine.runner import load_checkpoint
    work = str(tmp_path / 'w')
    run(TRAIN, SEG, '--work-dir', work, *seg_options(shapes, 2), cwd=ROOT)
    path = osp.join(work, 'iter_2.pth')
    with pytest.raises(Exception):
        torch.load(path)  # torch's default refuses mmengine's numpy metadata
    ckpt = load_checkpoint_file(path)
    assert set(ckpt['random_state']) >= {'python', 'numpy', 'torch'}

    import flatten_mm  # noqa: F401  (patches mmengine's loader)
    from mmseg.registry import MODELS
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    init_default_scope('mmseg')
    model = MODELS.build(Config.fromfile(SEG).model)
    load_checkpoint(model, path, map_location='cpu')
    torch.testing.assert_close(model.state_dict()['backbone.pos_embed1'],
                               ckpt['state_dict']['backbone.pos_embed1'])


TEARDOWN_ABORT = 'terminate called without an active exception'


def torchrun(nproc, *args, cwd):
    """A torchrun launch of ``nproc`` processes; the output. Python's fault
    handler prints every thread's stack if a process aborts. A launch that
    finished (rank 0 logged the evaluation's metrics) but one of whose
    processes then aborted in C++ teardown (seen twice in CI, before the barrier in
    tools/common.py; never in 90 launches on this machine) is launched once
    more, saying so; any other failure, or the same twice, fails the test."""
    cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}']
    env = dict(os.environ, PYTHONWARNINGS='ignore', OMP_NUM_THREADS='1', PYTHONFAULTHANDLER='1')
    for attempt in (1, 2):
        proc = subprocess.run([*cmd, f'--master_port={free_port()}', *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=900)
        log = proc.stdout + proc.stderr
        finished = 'mIoU: ' in log or 'coco/bbox_mAP: ' in log  # the last thing a run logs
        if proc.returncode == 0 or attempt == 2 or TEARDOWN_ABORT not in log or not finished:
            break
        warnings.warn(f'torchrun: a process aborted in teardown after the run finished; '
                      f'launched again. Its output ends:\n{log[-3000:]}')
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return log


@pytest.mark.heavy(32)
def test_two_process_training_matches_one_process(shapes, tmp_path):
    """2 gloo processes x 2 images == 1 process x 4 images (random flips off,
    so both see the same pixels). Gradients are summed in another order and
    AdamW's first steps amplify that rounding, so the bound (1e-4) is above
    rounding and well below what a run on half the data differs by (AdamW's
    first steps move each weight by about the learning rate, 1e-3); the
    figures are in docs/benchmarks.md, "Numerical margins of the tests"."""
    iters = 3
    # no flips (each process draws its own), full learning rate from the start
    # (AdamW then moves weights by ~1e-3 a step: unsynchronised runs differ that much)
    opts = seg_options(shapes, iters) + ['train_dataloader.dataset.pipeline.3.prob=0.0',
                                         'param_scheduler.0.start_factor=1.0']
    single = str(tmp_path / 'single')
    run(TRAIN, SEG, '--work-dir', single, *opts, cwd=ROOT, env=dict(OMP_NUM_THREADS='2'))
    dist = str(tmp_path / 'dist')
    log = torchrun(2, TRAIN, SEG, '--launcher', 'pytorch', '--work-dir', dist, *opts,
                   'train_dataloader.batch_size=2', cwd=ROOT)
    assert 'Distributed launcher: pytorch' in log and 'GPU number: 2' in log  # = processes
    worst = assert_same_weights(weights(osp.join(single, f'iter_{iters}.pth')),
                                weights(osp.join(dist, f'iter_{iters}.pth')), atol=1e-4)
    print(f'largest weight difference after {iters} iterations: {worst:.2e}')


def test_detection_demo_runs_distributed(shapes, tmp_path):
    """DDP without find_unused_parameters: a parameter that forward does not
    use (anywhere in the detector) fails the second iteration."""
    work = str(tmp_path / 'det')
    log = torchrun(2, TRAIN, DET, '--launcher', 'pytorch', '--work-dir', work,
                   *det_options(shapes, 2), 'train_dataloader.batch_size=2',
                   'find_unused_parameters=False',
                   'model.train_cfg.rpn_proposal.max_per_img=100', cwd=ROOT)
    assert 'Distributed launcher: pytorch' in log and 'GPU number: 2' in log
    assert len(losses(log)) == 2 and osp.exists(osp.join(work, 'iter_2.pth'))
    assert 'coco/bbox_mAP' in log


def test_cpu_distributed_rejects_what_cannot_run():
    from mmengine.config import Config

    from flatten_mm import setup_distributed
    cfg = Config(dict(launcher='slurm', model=dict(norm_cfg=dict(type='GN'))))
    with pytest.raises(ValueError, match="launcher='slurm' needs GPUs"):
        setup_distributed(cfg)
    cfg = Config(dict(launcher='pytorch', model=dict(norm_cfg=dict(type='SyncBN'))))
    with pytest.raises(ValueError, match='SyncBN, which runs only on GPUs'):
        setup_distributed(cfg)
    cfg = Config(dict(launcher='none'))
    setup_distributed(cfg)
    assert 'model_wrapper_cfg' not in cfg


def upstream_tool(package):
    import importlib
    path = osp.join(osp.dirname(importlib.import_module(package).__file__),
                    '.mim', 'tools', 'train.py')
    assert osp.isfile(path), f'{package} ships no {path}'
    return path


def test_mmdet_own_train_script_trains_our_detection_config(shapes, tmp_path):
    work = str(tmp_path / 'det')
    log = run(upstream_tool('mmdet'), DET, '--work-dir', work, *det_options(shapes, 2),
              'model.train_cfg.rpn_proposal.max_per_img=100', cwd=ROOT)
    assert len(losses(log)) == 2 and 'coco/bbox_mAP' in log
    assert 'FLattenPVT' in open(glob.glob(osp.join(work, '*', 'vis_data', 'config.py'))[0]).read()


def test_mmseg_own_train_script_trains_our_segmentation_config(shapes, tmp_path):
    work = str(tmp_path / 'seg')
    log = run(upstream_tool('mmseg'), SEG, '--work-dir', work, *seg_options(shapes, 2), cwd=ROOT)
    assert len(losses(log)) == 2 and 'mIoU' in log
    assert osp.exists(osp.join(work, 'iter_2.pth'))


def test_train_and_test_scripts_end_the_process_group(monkeypatch):
    """tools/train.py and tools/test.py destroy the process group of a
    distributed launch when the run ends (left to interpreter exit, gloo's
    threads can abort a finished run with exit code -6), even if it failed;
    after a finished run, only once every rank got there (a barrier), never
    after a failure (the other ranks may never come)."""
    import torch.distributed as dist
    monkeypatch.syspath_prepend(osp.join(ROOT, 'tools'))
    import common
    import train

    class Run:
        def __init__(self, fails):
            self.fails = fails

        def train(self):
            if self.fails:
                raise RuntimeError('the run failed')

    barriers = []
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, 'barrier', lambda *a, **k: barriers.append(1) or real_barrier())
    monkeypatch.setattr(train, 'build_config', lambda args: None)
    for fails in (True, False):
        monkeypatch.setattr(train.Runner, 'from_cfg', staticmethod(lambda cfg: Run(fails)))
        dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}',
                                rank=0, world_size=1)
        try:
            if fails:
                with pytest.raises(RuntimeError, match='the run failed'):
                    train.main([SEG])
            else:
                train.main([SEG])
            assert not dist.is_initialized()
            assert len(barriers) == (0 if fails else 1)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    common.end_distributed(True)  # no process group: nothing to do


@pytest.mark.heavy(93)
def test_compile_trains_the_demo_mask_rcnn(shapes, tmp_path):
    # mmengine's compile=True compiles the whole train_step: without
    # EagerOptimizerStepHook, which tools/train.py adds, dynamo stopped at the
    # optimizer's ConfigDict groups or (PlainParamGroupsHook) compiled its step
    # once a group until its recompile limit (8). aot_eager keeps dynamo's tracing and AOT autograd
    # and skips Inductor's C++ code generation (minutes on this CPU); the
    # default backend is measured in docs/advanced.md.
    config = osp.join(ROOT, 'configs/demo/mask-rcnn_flatten-pvtv2-b0_fpn_shapes.py')
    log = run(TRAIN, config, '--work-dir', str(tmp_path), *det_options(shapes, 2),
              'compile.backend=aot_eager', 'model.train_cfg.rpn_proposal.max_per_img=100', cwd=ROOT)
    found = losses(log)
    assert len(found) == 2 and all(0 < x < 10 for x in found), found
    assert 'coco/bbox_mAP' in log and 'recompile_limit' not in log
