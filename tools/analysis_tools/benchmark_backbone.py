"""Speed and memory of FLatten backbones next to their softmax counterparts.

    python tools/analysis_tools/benchmark_backbone.py \\
        --models flatten-pvt-t pvt-t flatten-swin-t swin-t \\
        --sizes 512 800x1333 1024 2048 --modes fwd fwdbwd --device cpu --threads 2

Every (model, size, mode, dtype) case runs in its own subprocess, so a case
that runs out of memory (or past ``--timeout``) is reported and the others go
on. Cases are interleaved: for each size/mode/dtype, one subprocess per model
in turn (A, B, A, B, ...) for ``--rounds`` rounds, so slow drifts of a shared
machine hit every model alike. Each subprocess times ``--iters`` steps after
``--warmup``; the table shows the median over all rounds and the ratio to the
model's baseline (``flatten-X`` against ``X``; see ``BASELINES``). The
process's CPU time per step (all threads) is reported next to the wall time:
on a shared machine whose other tenants take CPU away ("steal"), single
steps' wall times scatter by 20% and more, their CPU times by about 5%. So
is the host memory the step touched for the first time (minor page faults;
on CPUs the tensors' own): the C library hands big freed buffers back to the
kernel, and a step whose tensors land on new pages pays for their first touch.

Memory:
* CUDA: peak allocated bytes during the steps, above what the model and
  input already held (``torch.cuda.max_memory_allocated``).
* CPU, fwdbwd: bytes autograd saves for backward (unique storages, input and
  parameters excluded), which is what grows with resolution.
* CPU, both modes: growth of the process's peak resident memory during the
  steps (``ru_maxrss``); coarse, as it includes allocator caching.

Models: ``flatten-pvt-{t,s,m}``, ``flatten-pvtv2-b{0,1,2}``, ``flatten-swin-{t,s}``,
``flatten-cswin-{t,s}`` (flatten_mm), their softmax counterparts ``pvt-{t,s,m}``,
``pvtv2-b{0,1,2}``, ``swin-{t,s}`` (mmdet's backbones) and ``cswin-{t,s}``
(``FLattenCSwin`` with ``attn_type='SSSS'``: CSWin's stripes in every stage), ``NAME@reference`` for a flatten model
whose linear attention runs the plain reference code (official op order),
``NAME@identity`` for a flatten model whose attention term is its query (out = q;
the DWC term, projections and everything else kept; :func:`free_core`): the
step with a free attention core, the bound no faster core can beat, and
``NAME@torch`` for a flatten model whose attention layers run the core and
the DWC term on the ``'torch'`` backend (PyTorch ops, as on CPUs), not the
Triton kernels a GPU gets by default: when both are timed, ``flatten-X``'s
ratio is taken against ``flatten-X@torch`` instead of ``X``, so the pair says
what the kernels give the whole step, and
``NAME@rev`` for a flatten model built from another checkout of flatten_mm
(``--rev-dir``, e.g. a ``git worktree`` of an older commit), to time two
versions of the code side by side.
``timm:NAME`` is the whole timm classifier NAME (ours are registered with
flatten_mm) at its input size (``--sizes 224`` for most), with stochastic depth
(``drop_path_rate`` ``TIMM_DROP_PATH``, as in ImageNet training: timm's PVTv2 and
DeiT default to none): ``timm:flatten_X`` is compared
with timm's softmax counterpart in ``TIMM_BASELINES`` (Swin, PVTv2, DeiT), and
the table's images/s is the throughput (``--batch`` over the median step).
``release:NAME`` is the authors' classifier NAME (``RELEASE``: ``flatten_pvt_tiny``,
``flatten_pvt_v2_b1``, ``flatten_swin_tiny``, ``flatten_cswin_tiny``) from a
checkout of their FLatten-Transformer repository (``--release-dir``; it needs
timm and einops), built with the arguments of its ``cfgs/*.yaml`` as its
``build_model`` passes them, and compared with ours (``timm:NAME``) when both
are timed: its ratio is the release's time over ours.
``--compile [BACKEND]`` runs every model through ``torch.compile`` (default
settings, Inductor unless BACKEND is given); the ``--warmup`` steps compile
(at least one is needed).
Writes ``results.json``, ``results.csv`` and ``results.png`` to ``--out-dir``.
"""
import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import types
from typing import NamedTuple, Optional
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # flatten_mm without an install (e.g. a bare GPU box)

PVT_LAYERS = dict(t=[2, 2, 2, 2], s=[3, 4, 6, 3], m=[3, 4, 18, 3])
PVTV2 = dict(b0=(32, [2, 2, 2, 2]), b1=(64, [2, 2, 2, 2]), b2=(64, [3, 4, 6, 3]))
SWIN = dict(t=('tiny', [2, 2, 6, 2]), s=('small', [2, 2, 18, 2]))
CSWIN = dict(t='tiny', s='small')
# the variants NAME@VARIANT of a flatten model (module docstring)
VARIANTS = ('', 'reference', 'identity', 'torch', 'rev')
# the variants flatten-X is compared with, instead of X, when one is timed beside it
SELF_BASELINES = ('rev', 'torch')


# the stochastic depth every timm:NAME model is built with (build_model)
TIMM_DROP_PATH = 0.1

# timm's softmax model for each of ours (PVT v1 and CSWin are not in timm)
TIMM_BASELINES = dict(
    flatten_swin_tiny='swin_tiny_patch4_window7_224',
    flatten_swin_small='swin_small_patch4_window7_224',
    flatten_swin_base='swin_base_patch4_window7_224',
    flatten_deit_tiny='deit_tiny_patch16_224', flatten_deit_small='deit_small_patch16_224',
    flatten_deit_base='deit_base_patch16_224',
    **{f'flatten_pvt_v2_b{i}': f'pvt_v2_b{i}' for i in range(6)})


# the authors' classifiers: (module of their models/, builder, the arguments their
# build_model passes from cfgs/<name>.yaml and config.py's defaults)
_LA = dict(focusing_factor=3, kernel_size=5)
_PVT = dict(_LA, drop_path_rate=0.1, attn_type='LLLL', la_sr_ratios='1111')
RELEASE = dict(
    flatten_pvt_tiny=('flatten_pvt', 'flatten_pvt_tiny', _PVT),
    flatten_pvt_v2_b1=('flatten_pvt_v2', 'flatten_pvt_v2_b1', _PVT),
    flatten_swin_tiny=('flatten_swin', 'FLattenSwinTransformer', dict(
        _LA, img_size=224, patch_size=4, in_chans=3, num_classes=1000, embed_dim=96,
        depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24], window_size=56, mlp_ratio=4.0,
        qkv_bias=True, qk_scale=None, drop_rate=0.0, drop_path_rate=0.2, ape=False,
        patch_norm=True, use_checkpoint=False, attn_type='LLSS')),
    flatten_cswin_tiny=('flatten_cswin', 'FLatten_CSWin_64_24181_tiny_224', dict(
        _LA, img_size=224, in_chans=3, num_classes=1000, drop_rate=0.0, drop_path_rate=0.2,
        attn_type='LLSS', la_split_size='56-28-14-7')))


def release_source(name: str, release_dir: Optional[str]) -> tuple:
    """(module, builder, arguments) of ``release:NAME``; ValueError unless
    ``release_dir`` holds the module."""
    module, builder, kwargs = RELEASE[name[len('release:'):]]
    if not release_dir or not (Path(release_dir) / 'models' / f'{module}.py').is_file():
        raise ValueError(f"{name} needs --release-dir, a checkout of the authors' "
                         f'FLatten-Transformer with models/{module}.py; got {release_dir!r}')
    return module, builder, kwargs


def build_release(name: str, release_dir: Optional[str]):
    """The authors' classifier ``release:NAME`` from their checkout (``RELEASE``)."""
    import importlib
    module, builder, kwargs = release_source(name, release_dir)
    sys.path.insert(0, release_dir)  # their models package
    return getattr(importlib.import_module(f'models.{module}'), builder)(**kwargs)


def timm_names() -> list:
    """Every timm model, ours included (registered by importing flatten_mm)."""
    import timm

    import flatten_mm  # noqa: F401  (registers the flatten_* names)
    return timm.list_models()


def model_names():
    names = []
    for k in PVT_LAYERS:
        names += [f'flatten-pvt-{k}', f'pvt-{k}']
    for k in PVTV2:
        names += [f'flatten-pvtv2-{k}', f'pvtv2-{k}']
    for k in SWIN:
        names += [f'flatten-swin-{k}', f'swin-{k}']
    for k in CSWIN:
        names += [f'flatten-cswin-{k}', f'cswin-{k}']
    return names


def baseline_of(name: str):
    """``flatten-X`` (or ``flatten-X@reference``, ``flatten-X@rev``, ...) is
    compared with ``X``; but ``flatten-X`` with ``flatten-X@rev`` or
    ``flatten-X@torch`` when one is timed (:data:`SELF_BASELINES`)."""
    base = name.split('@')[0]
    if base.startswith('release:'):  # the authors' against ours
        return 'timm:' + base[len('release:'):]
    if base.startswith('timm:'):
        theirs = TIMM_BASELINES.get(base[len('timm:'):])
        return theirs and 'timm:' + theirs
    return base[len('flatten-'):] if base.startswith('flatten-') else None


def check_model_name(name: str) -> None:
    if name.startswith('release:'):
        if name[len('release:'):] not in RELEASE:
            raise ValueError(f'unknown release model {name!r}; choose from '
                             f'{["release:" + n for n in RELEASE]}')
        return
    if name.startswith('timm:'):
        if name[len('timm:'):] not in timm_names():
            raise ValueError(f'unknown timm model {name[len("timm:"):]!r} in {name!r} '
                             '(see timm.list_models(); ours are flatten_*)')
        return
    base, _, variant = name.partition('@')
    if base not in model_names() or variant not in VARIANTS \
            or (variant and not base.startswith('flatten-')):
        raise ValueError(f'unknown model {name!r}; choose from {model_names()} (flatten '
                         'ones also as NAME@reference, NAME@identity, NAME@torch or NAME@rev)')


def check_model_names(parser: argparse.ArgumentParser, names) -> None:
    """``parser.error`` naming the first unknown model of ``names``."""
    for name in names:
        try:
            check_model_name(name)
        except ValueError as err:
            parser.error(str(err))


def model_outputs(out) -> list:
    """A backbone's maps, or a classifier's logits as a one-item list."""
    return list(out) if isinstance(out, (list, tuple)) else [out]


def training_loss(out):
    """A timed training step's loss of a model's output: the sum of the fp32
    means of its maps (or logits)."""
    return sum(o.float().mean() for o in model_outputs(out))


def build_model(name: str, release_dir: Optional[str] = None):
    """The backbone called ``name`` (see the module docstring); ``release:`` models
    from ``release_dir``."""
    check_model_name(name)
    if name.startswith('release:'):
        return build_release(name, release_dir)
    if name.startswith('timm:'):
        import timm
        # stochastic depth in every timm model, as in ImageNet training, ours and
        # the release's (timm's PVTv2 and DeiT default to none, and skip its work)
        return timm.create_model(name[len('timm:'):], pretrained=False,
                                 drop_path_rate=TIMM_DROP_PATH)
    base, _, variant = name.partition('@')
    family, _, size = base.rpartition('-')
    if family == 'cswin':  # CSWin: the same class with softmax stripes in every stage
        from flatten_mm.models.backbones import FLattenCSwin
        return FLattenCSwin(arch=CSWIN[size], attn_type='SSSS')
    if family.startswith('flatten'):
        from flatten_mm.models.backbones import FLattenCSwin, FLattenPVT, FLattenPVTv2, FLattenSwin
        arch = {'t': 'tiny', 's': 'small', 'm': 'medium'}.get(size, size)
        cls = dict(zip(['flatten-pvt', 'flatten-pvtv2', 'flatten-swin', 'flatten-cswin'],
                       [FLattenPVT, FLattenPVTv2, FLattenSwin, FLattenCSwin]))[family]
        return with_attention_variant(cls(arch=arch), variant)
    from mmdet.models.backbones import (PyramidVisionTransformer,
                                        PyramidVisionTransformerV2, SwinTransformer)
    if family == 'pvt':
        return PyramidVisionTransformer(num_layers=PVT_LAYERS[size])
    if family == 'pvtv2':
        dims, layers = PVTV2[size]
        return PyramidVisionTransformerV2(embed_dims=dims, num_layers=layers)
    # stochastic depth as FLattenSwin's default and mmdet's Swin detection configs
    return SwinTransformer(depths=SWIN[size][1], drop_path_rate=0.2)


def on_torch_backend(self, *args, **kwargs):
    """A layer's own forward with the attention ops on the 'torch' backend (and
    its backward: autograd keeps the functions the forward chose)."""
    from flatten_mm.models.ops.dispatch import use_backend
    with use_backend('torch'):
        return type(self).forward(self, *args, **kwargs)


def on_reference(self, x, hw_shape, key_mask=None):
    """A layer's forward by the plain reference code."""
    from flatten_mm.analysis import reference_forward
    return reference_forward(self, x, hw_shape)


def with_attention_variant(model, variant: str):
    """``model`` with every focused linear attention layer's core swapped for
    ``variant``'s, or with both its ops on the torch backend (see the module
    docstring; '' or 'rev': as built). Forwards are bound methods, so that a
    deep copy of the model runs its own layers."""
    from flatten_mm.models.attention import FocusedLinearAttention
    forwards = dict(torch=on_torch_backend, reference=on_reference)
    for m in model.modules():
        if not isinstance(m, FocusedLinearAttention):
            continue
        if variant in forwards:
            m.forward = types.MethodType(forwards[variant], m)
        elif variant == 'identity':
            m.attend = types.MethodType(free_core, m)
    return model


def free_core(self, q, k, v, key_mask, overwrite_qk=False, grids=None):
    """An ``attend`` whose attention term is its query (out = q): no focusing
    map, no state, no sums. q itself where nothing writes into it: the layer's
    fused conv op takes the local term and writes a new tensor (then the layer
    makes one op, reading q and V, as a fused layer would with a core that cost
    nothing; a layer whose ``attend`` is replaced takes its core and DWC as two
    ops), or there is no local term. A new tensor, as any core writes, where the
    'torch' backend adds the local term into it in place: q (a view of the q, k,
    v product; with reduced keys the q projection's output) must not be written."""
    from flatten_mm.models.designs import local_kernel
    from flatten_mm.models.ops.dispatch import choose
    kernel = local_kernel(self)
    # the layer hands the op V on the query grid (resized with reduced keys): the
    # choice reads the tensors' device and dtype, which V's resized form keeps
    in_place = kernel is not None and choose('conv_add', q, v, *kernel) == 'torch'
    return q.clone() if in_place else q


# ----------------------------------------------------------------- worker

class Step(NamedTuple):
    """One timed step: wall and process CPU seconds, and the MiB of host
    memory it touched for the first time (minor page faults; on CUDA only
    the host side, the GPU's memory is the peak below)."""
    wall_s: float
    cpu_s: float
    faulted_MiB: float


def rss_bytes() -> int:
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


class Case:
    """One (model, size, mode, dtype) case, built in this process."""

    def __init__(self, spec: dict):
        if spec['model'].endswith('@rev'):
            if not spec.get('rev_dir'):
                raise ValueError('NAME@rev models need --rev-dir')
            sys.path.insert(0, spec['rev_dir'])  # its flatten_mm comes first
        import torch
        if spec.get('threads'):
            torch.set_num_threads(spec['threads'])
        self.spec, self.torch = spec, torch
        self.device = torch.device(spec['device'])
        dtype = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)[spec['dtype']]
        torch.manual_seed(0)
        self.model = build_model(spec['model'], spec.get('release_dir')).to(self.device)
        self.model.train(spec['mode'] == 'fwdbwd')
        if spec.get('compile'):  # compiled at the first (warm-up) step
            self.model = torch.compile(self.model, backend=spec['compile'])
        self.x = torch.randn(spec.get('batch', 1), 3, *spec['size'], device=self.device)
        self.autocast = torch.autocast(self.device.type, dtype=dtype,
                                       enabled=dtype != torch.float32)
        if self.device.type == 'cuda':
            torch.cuda.reset_peak_memory_stats(self.device)
            self.held = torch.cuda.memory_allocated(self.device)
        self.rss_before = rss_bytes()

    def step(self) -> Step:
        """One forward (no_grad) or forward + backward, timed."""
        torch, model = self.torch, self.model
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c0, t0 = time.process_time(), time.perf_counter()
        if self.spec['mode'] == 'fwd':
            with torch.no_grad(), self.autocast:
                model(self.x)
        else:
            with self.autocast:
                out = model(self.x)
            training_loss(out).backward()
            model.zero_grad(set_to_none=True)
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        page = os.sysconf('SC_PAGE_SIZE')
        return Step(wall, cpu, faults * page / 2 ** 20)

    def memory(self) -> dict:
        torch, model, x = self.torch, self.model, self.x
        if self.device.type == 'cuda':
            return dict(peak_MiB=(torch.cuda.max_memory_allocated(self.device) - self.held)
                        / 2 ** 20)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result = dict(rss_growth_MiB=max(0, peak - self.rss_before) / 2 ** 20)
        if self.spec['mode'] == 'fwdbwd':
            from flatten_mm.analysis import saved_tensor_bytes
            with self.autocast:
                outs, nbytes = saved_tensor_bytes(lambda: model(x), [x, *model.parameters()])
            result['saved_MiB'] = nbytes / 2 ** 20
        return result


def run_worker(spec: dict) -> dict:
    case = Case(spec)
    steps = [case.step() for _ in range(spec['warmup'] + spec['iters'])][spec['warmup']:]
    return dict(spec, times_ms=[1000 * s.wall_s for s in steps],
                cpu_ms=[1000 * s.cpu_s for s in steps],
                faulted_MiB=[s.faulted_MiB for s in steps], **case.memory())


def serve_worker(spec: dict) -> None:
    """--paired: warm up, then time one step per 'step' line on stdin."""
    case = Case(spec)
    for _ in range(spec['warmup']):
        case.step()
    print('READY', flush=True)
    for line in sys.stdin:
        if line.strip() != 'step':
            break
        s = case.step()
        print(f'TIME {1000 * s.wall_s} {1000 * s.cpu_s} {s.faulted_MiB}', flush=True)
    print('RESULT ' + json.dumps(dict(spec, status='ok', **case.memory())), flush=True)


def run_paired(specs: list, steps: int) -> list:
    """One live worker per model; steps interleaved A, B, A, B, ... so every
    pair of neighbouring steps saw the same machine."""
    procs = [subprocess.Popen([sys.executable, __file__, '--serve', json.dumps(s)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for s in specs]
    series = ('times_ms', 'cpu_ms', 'faulted_MiB')  # one number per step, in TIME's order
    results = [dict(s, status='ok', **{k: [] for k in series}) for s in specs]

    def reply(i: int, prefix: str):
        for line in procs[i].stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        results[i]['status'] = f'failed (exit {procs[i].wait()})'
        return None

    for i in range(len(specs)):
        reply(i, 'READY')
    for _ in range(steps):
        for i, proc in enumerate(procs):
            if results[i]['status'] != 'ok':
                continue
            proc.stdin.write('step\n')
            proc.stdin.flush()
            t = reply(i, 'TIME ')
            if t is not None:
                for key, value in zip(series, t.split()):
                    results[i][key].append(float(value))
    for i, proc in enumerate(procs):
        if results[i]['status'] == 'ok':
            proc.stdin.write('done\n')
            proc.stdin.flush()
            text = reply(i, 'RESULT ')
            if text is not None:
                results[i].update(json.loads(text), **{k: results[i][k] for k in series})
        proc.wait()
    return results


def worker_main(text: str) -> None:
    spec = json.loads(text)
    if spec['device'] == 'cpu' and spec.get('mem_limit_gb'):
        limit = int(spec['mem_limit_gb'] * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        result = run_worker(spec)
        result['status'] = 'ok'
    except (MemoryError, RuntimeError) as err:  # torch.cuda.OutOfMemoryError is a RuntimeError
        text = str(err)
        if 'out of memory' in text.lower() or 'allocate' in text.lower() \
                or isinstance(err, MemoryError):
            result = dict(spec, status='out of memory', error=text.splitlines()[0][:200])
        else:
            raise
    print('RESULT ' + json.dumps(result), flush=True)


# ------------------------------------------------------------------ parent

def parse_size(text: str):
    parts = text.lower().split('x')
    try:
        size = [int(p) for p in parts]
    except ValueError:
        size = []
    if len(size) == 1:
        size *= 2
    if len(size) != 2 or min(size) < 1:
        raise argparse.ArgumentTypeError(f'a size is S or HxW (e.g. 800x1333), got {text!r}')
    return size


def run_case(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, __file__, '--worker', json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, status=f'timeout ({timeout:.0f} s)')
    for line in proc.stdout.splitlines():
        if line.startswith('RESULT '):
            return json.loads(line[len('RESULT '):])
    if proc.returncode < 0:  # killed by a signal: the kernel's OOM killer, mostly
        status = f'killed by signal {-proc.returncode} (out of memory?)'
    else:
        status = f'failed (exit {proc.returncode}): ' + (proc.stderr.strip().splitlines() or [''])[-1][:200]
    return dict(spec, status=status)


def self_baseline(rows: dict, model: str, size, mode: str, dtype: str) -> Optional[dict]:
    """The row of ``model`` as another version (NAME@rev) or with its attention
    ops on PyTorch (NAME@torch), if one was timed: what ``model`` is compared with."""
    if '@' in model:
        return None
    return next((rows[key] for key in ((f'{model}@{v}', size, mode, dtype)
                                       for v in SELF_BASELINES) if key in rows), None)


def summarise(results):
    rows = {}
    for r in results:
        key = (r['model'], tuple(r['size']), r['mode'], r['dtype'])
        row = rows.setdefault(key, dict(model=r['model'], size='x'.join(map(str, r['size'])),
                                        pixels=r['size'][0] * r['size'][1],
                                        batch=r.get('batch', 1), mode=r['mode'],
                                        dtype=r['dtype'], device=r['device'], status='ok',
                                        times_ms=[], cpu_ms=[], faulted_MiB=[],
                                        paired=r.get('paired', False),
                                        compiled=r.get('compile')))
        if r['status'] != 'ok':
            row['status'] = r['status']
            continue
        row['times_ms'] += r['times_ms']
        row['cpu_ms'] += r.get('cpu_ms', [])
        row['faulted_MiB'] += r.get('faulted_MiB', [])
        for k in ('peak_MiB', 'saved_MiB', 'rss_growth_MiB'):
            if k in r:
                row[k] = max(row.get(k, 0), r[k])
    for row in rows.values():
        row['median_ms'] = statistics.median(row['times_ms']) if row['status'] == 'ok' else None
        row['images_per_s'] = (row['batch'] * 1e3 / row['median_ms']) if row['median_ms'] else None
        row['cpu_median_ms'] = statistics.median(row['cpu_ms']) if row['cpu_ms'] else None
        row['faulted_median_MiB'] = (statistics.median(row['faulted_MiB'])
                                     if row['faulted_MiB'] else None)
    for (model, size, mode, dtype), row in rows.items():
        base = self_baseline(rows, model, size, mode, dtype) or \
            rows.get((baseline_of(model), size, mode, dtype))
        row['baseline'] = base['model'] if base else None
        if base and row['median_ms'] and base['median_ms']:
            for steps, ratio, spread in (('times_ms', 'time_ratio', 'ratio_range'),
                                         ('cpu_ms', 'cpu_ratio', 'cpu_ratio_range')):
                ours, theirs = row[steps], base[steps]
                if not (ours and theirs):
                    continue
                row[ratio] = statistics.median(ours) / statistics.median(theirs)
                if row.get('paired') and len(ours) == len(theirs):
                    # median and range of the step-by-step ratios
                    pairs = sorted(a / b for a, b in zip(ours, theirs))
                    row[ratio] = statistics.median(pairs)
                    row[spread] = [pairs[0], pairs[-1]]
            for k in ('peak_MiB', 'saved_MiB'):
                if k in row and base.get(k):
                    row[k.split('_')[0] + '_ratio'] = row[k] / base[k]
    return list(rows.values())


def fmt(v, spec='.0f'):
    return '-' if v is None else format(v, spec)


def write_outputs(rows, out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / 'results.json').write_text(json.dumps(rows, indent=1))
    fields = ['model', 'baseline', 'size', 'pixels', 'batch', 'mode', 'dtype', 'device',
              'compiled', 'status',
              'median_ms', 'images_per_s', 'time_ratio', 'ratio_range', 'cpu_median_ms', 'cpu_ratio',
              'cpu_ratio_range', 'peak_MiB', 'peak_ratio', 'saved_MiB', 'saved_ratio',
              'rss_growth_MiB', 'faulted_median_MiB']
    with open(out_dir / 'results.csv', 'w', newline='') as f:
        writer = csv.DictWriter(f, fields, extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)
    try:
        plot(rows, out_dir / 'results.png')
    except ImportError:
        print('matplotlib is not installed: no plot')


def plot(rows, path: Path):
    """Time (both modes) and memory (its measure) against megapixels, one
    colour per model, solid for fwdbwd, dotted for fwd; an x marks a case
    that failed (out of memory, timeout) at its size."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    mem_key = 'peak_MiB' if any('peak_MiB' in r for r in rows) else 'saved_MiB'
    with_memory = any(mem_key in r for r in rows)  # forward-only CPU runs have none
    models = list(dict.fromkeys(r['model'] for r in rows))
    colour = {m: f'C{i}' for i, m in enumerate(models)}
    fig, axes = plt.subplots(1, 2 if with_memory else 1, figsize=(12 if with_memory else 6, 4.5),
                             squeeze=False)
    axes = axes[0]
    groups = {}
    for r in rows:
        groups.setdefault((r['model'], r['mode'], r['dtype']), []).append(r)
    for (model, mode, dtype), rs in groups.items():
        rs.sort(key=lambda r: r['pixels'])
        ok = [r for r in rs if r['status'] == 'ok']
        style = dict(color=colour[model], linestyle='-' if mode == 'fwdbwd' else ':', marker='o')
        label = f'{model} {mode} {dtype}'
        if ok:
            axes[0].plot([r['pixels'] / 1e6 for r in ok], [r['median_ms'] / 1e3 for r in ok],
                         label=label, **style)
            mem = [(r['pixels'] / 1e6, r[mem_key]) for r in ok if mem_key in r]
            if mem and with_memory:
                axes[1].plot(*zip(*mem), label=label, **style)
        for r in rs:
            if r['status'] != 'ok':
                top = max((x['median_ms'] / 1e3 for x in rows if x['median_ms']), default=1)
                axes[0].plot(r['pixels'] / 1e6, top, 'x', color=colour[model], markersize=10)
                axes[0].annotate(f"{model} {mode}: {r['status']}", (r['pixels'] / 1e6, top),
                                 textcoords='offset points', xytext=(-150, -12), fontsize=7)
    axes[0].set(xlabel='megapixels', ylabel='median seconds per step', title='time')
    if with_memory:
        axes[1].set(xlabel='megapixels', ylabel=mem_key.replace('_', ' '), title='memory')
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(rows):
    mem = 'peak_MiB' if any('peak_MiB' in r for r in rows) else 'saved_MiB'
    print(f'| model | size | mode | dtype | median ms | images/s | x baseline | range | '
          f'CPU-time x baseline '
          f'| range | {mem} | x baseline | MiB faulted per step | status |')
    print('|---|---|---|---|---|---|---|---|---|---|---|---|---|---|')

    def spread(r, key):
        return '-' if key not in r else '{:.2f}-{:.2f}'.format(*r[key])
    for r in rows:
        print(f"| {r['model']} | {r['size']} | {r['mode']} | {r['dtype']} | "
              f"{fmt(r['median_ms'])} | {fmt(r.get('images_per_s'), '.1f')} | "
              f"{fmt(r.get('time_ratio'), '.2f')} | "
              f"{spread(r, 'ratio_range')} | {fmt(r.get('cpu_ratio'), '.2f')} | "
              f"{spread(r, 'cpu_ratio_range')} | "
              f"{fmt(r.get(mem), '.0f')} | {fmt(r.get(mem.split('_')[0] + '_ratio'), '.2f')} | "
              f"{fmt(r.get('faulted_median_MiB'), '.0f')} | {r['status']} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+',
                        default=['flatten-pvt-t', 'pvt-t', 'flatten-pvt-s', 'pvt-s',
                                 'flatten-pvtv2-b1', 'pvtv2-b1', 'flatten-swin-t', 'swin-t'])
    parser.add_argument('--sizes', nargs='+', type=parse_size,
                        default=[[512, 512], [800, 1333], [1024, 1024], [2048, 2048]])
    parser.add_argument('--modes', nargs='+', choices=['fwd', 'fwdbwd'], default=['fwd', 'fwdbwd'])
    parser.add_argument('--dtypes', nargs='+', choices=['fp32', 'bf16', 'fp16'], default=None,
                        help='default: fp32, plus bf16 on a GPU that supports it')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--batch', type=int, default=1, help='images per step')
    parser.add_argument('--threads', type=int, default=None, help='CPU threads per case')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--iters', type=int, default=2, help='timed steps per subprocess')
    parser.add_argument('--warmup', type=int, default=1,
                        help='untimed steps per subprocess (with --compile: the compilation)')
    parser.add_argument('--compile', nargs='?', const='inductor', metavar='BACKEND',
                        help='torch.compile every model before timing (default settings; BACKEND: '
                        'inductor unless given)')
    parser.add_argument('--timeout', type=float, default=900, help='seconds per subprocess')
    parser.add_argument('--mem-limit-gb', type=float, default=None,
                        help='CPU: address-space limit per case (default: 80%% of RAM)')
    parser.add_argument('--out-dir', default='work_dirs/benchmark_backbone')
    parser.add_argument('--rev-dir', help='checkout of another flatten_mm version, for NAME@rev')
    parser.add_argument('--release-dir',
                        help="checkout of the authors' FLatten-Transformer, for release:NAME")
    parser.add_argument('--paired', action='store_true',
                        help='keep one worker per model alive and interleave single steps; '
                             'ratios are medians of step-by-step ratios (needs the memory '
                             'of all models at once)')
    parser.add_argument('--worker', help=argparse.SUPPRESS)
    parser.add_argument('--serve', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.serve:
        return serve_worker(json.loads(args.serve))
    check_model_names(parser, args.models)
    for name in args.models:
        if name.startswith('release:'):
            try:
                release_source(name, args.release_dir)
            except ValueError as err:
                parser.error(str(err))
    if args.dtypes is None:
        args.dtypes = ['fp32']
        if args.device.startswith('cuda'):
            import torch
            if torch.cuda.is_bf16_supported():
                args.dtypes.append('bf16')
    if args.mem_limit_gb is None and args.device == 'cpu':
        args.mem_limit_gb = 0.8 * os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2 ** 30
    results, failed = [], set()
    if args.compile and args.warmup < 1:
        parser.error('--compile needs --warmup >= 1 (the first step compiles)')
    common = dict(device=args.device, batch=args.batch, threads=args.threads,
                  warmup=args.warmup, compile=args.compile,
                  rev_dir=args.rev_dir and str(Path(args.rev_dir).resolve()),
                  release_dir=args.release_dir and str(Path(args.release_dir).resolve()))
    for size in args.sizes:
        for mode in args.modes:
            for dtype in args.dtypes:
                case = dict(common, size=size, mode=mode, dtype=dtype)
                if args.paired:
                    specs = [dict(case, model=m, paired=True) for m in args.models]
                    for r in run_paired(specs, args.rounds * args.iters):
                        results.append(r)
                        print(f"{r['model']} {size[0]}x{size[1]} {mode} {dtype}: {r['status']}, "
                              f"steps {[round(t) for t in r['times_ms']]} ms", flush=True)
                    continue
                for rnd in range(args.rounds):
                    for model in args.models:
                        key = (model, tuple(size), mode, dtype)
                        if key in failed:
                            continue
                        spec = dict(case, model=model, iters=args.iters,
                                    mem_limit_gb=args.mem_limit_gb)
                        r = run_case(spec, args.timeout)
                        results.append(r)
                        if r['status'] != 'ok':
                            failed.add(key)
                        print(f"[{rnd + 1}/{args.rounds}] {model} {size[0]}x{size[1]} {mode} "
                              f"{dtype}: {r['status']}"
                              + (f", {statistics.median(r['times_ms']):.0f} ms"
                                 if r['status'] == 'ok' else ''), flush=True)
    rows = summarise(results)
    write_outputs(rows, Path(args.out_dir))
    print_table(rows)
    return rows


if __name__ == '__main__':
    main()
