"""Train and evaluate one config with several attention designs, one table.

    python tools/analysis_tools/compare_attention.py CONFIG \\
        --designs focused relu hydra focused:focusing_factor=2 focused:kernel_size=0 \\
        --iters 200 --work-dir work_dirs/compare [--val-interval N] [--cfg-options k=v ...]

A design spec is a design name (``attn_design`` of the backbone), optionally
with knobs of that design after a colon, comma-separated:
``focused:focusing_factor=2,kernel_size=0``. Each spec sets
``model.backbone.attn_design`` and the knobs in the config and is trained with
mmengine's Runner (as tools/train.py) for ``--iters`` iterations, evaluated
with the config's evaluator, in its own work dir under ``--work-dir``, with
the same seed and ``randomness.deterministic=True`` (deterministic algorithms where
PyTorch has them; an op without one warns). Every spec is checked,
and every model built (params, FLOPs), before the first run trains.

Columns: params and FLOPs of the whole model (FLOPs as get_flops.py counts
them, at ``--shape``: default the config's data-preprocessor size, else the
validation pipeline's last crop or resize, else 224);
the median training step (``train_step``, the iterations after the first; the
batch is the config's) and inference per image (the validation iterations,
pre- and post-processing and the evaluator's per-batch work included, data
loading not); the metric the
evaluator reports first after the side figure aAcc (mmseg's IoUMetric's first key,
before ``mIoU``, ``mDice`` or ``mFscore``), or ``--metric``. Writes ``results.csv``,
``results.json`` and ``results.png`` (with matplotlib) to ``--work-dir``.
"""
import argparse
import csv
import inspect
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / 'tools'), str(Path(__file__).resolve().parent)]
from mmengine.config import Config, DictAction  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402

# the knobs a design spec may set, and the type of their values
KNOB_TYPES = {'focusing_factor': float, 'kernel_size': int}
# first keys that are a side figure: mmseg's IoUMetric puts the pixel accuracy first,
# before mIoU, mDice or mFscore (whichever its iou_metrics ask for)
SIDE_METRICS = ('aAcc', )
FIELDS = ['design', 'attn_design', 'knobs', 'params_M', 'flops_G', 'train_step_s',
          'infer_ms_per_img', 'metric', 'value', 'work_dir']


def known_designs() -> tuple:
    """The attention designs of flatten_mm (this checkout's: ROOT is first on sys.path)."""
    from flatten_mm.models.designs import DESIGNS
    return tuple(DESIGNS)


def design_knobs(name: str) -> Dict[str, type]:
    """The knobs of design ``name``: ``focusing_factor`` (p) is the focused
    design's, ``kernel_size`` (the DWC on V, 0 for none) that of every design
    with a DWC."""
    from flatten_mm.models.designs import DESIGNS
    names = (['focusing_factor'] if name == 'focused' else []) + \
        (['kernel_size'] if DESIGNS[name].dwc else [])
    return {k: KNOB_TYPES[k] for k in names}


class Spec(NamedTuple):
    text: str
    design: str
    knobs: Dict[str, object]

    @property
    def slug(self) -> str:
        """A folder name for this spec: focused_focusing_factor-2."""
        return re.sub(r'[^A-Za-z0-9.-]+', '_', self.text.replace('=', '-'))


def parse_spec(text: str, designs: tuple) -> Spec:
    """``name[:knob=value[,knob=value]]`` -> Spec; ValueError naming what is wrong."""
    name, colon, rest = text.partition(':')
    if name not in designs:
        raise ValueError(f'unknown attention design {name!r} in {text!r}; '
                         f'choose from {list(designs)}')
    allowed = design_knobs(name)
    knobs = {}
    for item in filter(None, rest.split(',')):
        key, eq, value = item.partition('=')
        if key not in allowed or not eq:
            what = f'knob {key!r}' if eq else f'knob {item!r} (write knob=value)'
            raise ValueError(f'{what} in {text!r}: design {name!r} takes '
                             f'{sorted(allowed) or "no knobs"}')
        if key in knobs:
            raise ValueError(f'knob {key!r} is given twice in {text!r}')
        try:
            knobs[key] = allowed[key](value)
        except ValueError:
            raise ValueError(f'knob {key}={value!r} in {text!r}: not '
                             f'{"an integer" if allowed[key] is int else "a number"}') from None
    if colon and not knobs:
        raise ValueError(f'empty knob list in {text!r}: write {name}:knob=value')
    return Spec(text, name, knobs)


def parse_specs(texts: List[str], designs: tuple) -> List[Spec]:
    specs = [parse_spec(t, designs) for t in texts]
    seen = {}
    for s in specs:  # the same run, however written (2 and 2.0, knobs in another order)
        run = (s.design, tuple(sorted(s.knobs.items())))
        if run in seen:
            same = '' if seen[run] == s.text else f' (as {seen[run]!r})'
            raise ValueError(f'design spec {s.text!r} is given twice{same}')
        seen[run] = s.text
    return specs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config', help='an mmseg / mmdet / mmpretrain config whose '
                        'backbone is a flatten_mm one')
    parser.add_argument('--designs', nargs='+', default=['focused', 'relu'],
                        help='design specs: NAME or NAME:knob=value[,knob=value]')
    parser.add_argument('--iters', type=int, default=100, help='training iterations per design')
    parser.add_argument('--val-interval', type=int, default=None,
                        help='evaluate every N iterations (default: once, at the end)')
    parser.add_argument('--work-dir', default='work_dirs/compare_attention',
                        help='one sub-folder per design, and the table files')
    parser.add_argument('--seed', type=int, default=0, help='the same for every design')
    parser.add_argument('--shape', type=int, nargs='+', default=None,
                        help='input H W for FLOPs (one number: square)')
    parser.add_argument('--threads', type=int, default=None,
                        help="torch's CPU threads (default: torch's choice); 1 keeps the "
                        'times steady on a machine shared with other jobs')
    parser.add_argument('--metric', help='the evaluator key to report (default: its first)')
    parser.add_argument('--keep-checkpoints', action='store_true',
                        help="keep the config's checkpoint hook (off: no checkpoints)")
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config entries of every run, e.g. '
                        'train_dataloader.batch_size=4')
    args = parser.parse_args(argv)
    if not Path(args.config).is_file():
        parser.error(f'config not found: {args.config}')
    if args.iters < 1:
        parser.error(f'--iters must be >= 1, got {args.iters}')
    if args.val_interval is not None and not 1 <= args.val_interval <= args.iters:
        parser.error(f'--val-interval must be between 1 and --iters ({args.iters}), '
                     f'got {args.val_interval}')
    if args.threads is not None and args.threads < 1:
        parser.error(f'--threads must be >= 1, got {args.threads}')
    if args.shape and (len(args.shape) not in (1, 2) or min(args.shape) < 1):
        parser.error(f'--shape takes H W or one size, got {args.shape}')
    return parser, args


def backbone_class(cfg: Config, config: str):
    """The flatten_mm class of the config's backbone; SystemExit otherwise."""
    from flatten_mm.models import backbones
    name = cfg.model.get('backbone', {}).get('type', '')
    cls = getattr(backbones, str(name).split('.')[-1], None)
    if not isinstance(cls, type):
        raise SystemExit(f'{config}: model.backbone.type is {name!r}, not a flatten_mm '
                         'backbone; compare_attention.py switches the attention of '
                         f'{[n for n in backbones.__all__ if n[0].isupper()]}')
    return cls


def apply_spec(cfg: Config, spec: Spec, cls) -> None:
    """model.backbone.attn_design and the knobs (attn_design only where the
    backbone takes it: 'focused' is every backbone's attention)."""
    takes = inspect.signature(cls).parameters
    if 'attn_design' in takes:
        cfg.model.backbone.attn_design = spec.design
    elif spec.design != 'focused':
        raise SystemExit(f'{cls.__name__} has no attn_design argument: it runs the '
                         f'focused design only, not {spec.design!r}')
    for key, value in spec.knobs.items():
        if key not in takes:
            raise SystemExit(f'{cls.__name__} takes no {key!r} (spec {spec.text!r})')
        cfg.model.backbone[key] = value


def check_pretrained(cfg: Config, spec: Spec, own: dict) -> None:
    """Stop if the model starts from a checkpoint of another design: weights
    learnt by one design (its parameters, its DWC's kernel) do not fit another,
    so the run would fail to load them or compare unlike starts. ``own``: the
    config's ``attn_design`` and ``kernel_size`` before the spec was applied."""
    init = cfg.model.backbone.get('init_cfg') or {}
    start = cfg.get('load_from') or (init.get('checkpoint') if isinstance(init, dict) and
                                     init.get('type') == 'Pretrained' else None)
    if not start:
        return
    changed = [f'{key}={cfg.model.backbone.get(key, own[key])!r}' for key in own
               if cfg.model.backbone.get(key, own[key]) != own[key]]
    if changed:
        raise SystemExit(
            f'design {spec.text!r}: the model starts from {start!r}, '
            f'weights of attn_design={own["attn_design"]!r}, kernel_size={own["kernel_size"]!r}, '
            f'which do not fit {", ".join(changed)}; compare from scratch with --cfg-options '
            f'model.backbone.init_cfg=None load_from=None, or train each design\'s own config '
            f'(configs/attention_designs) with tools/train.py')


def run_config(args, spec: Spec) -> Config:
    """The config of one design's run: iterations, evaluation, seed, work dir."""
    from flatten_mm.engine import add_hooks
    from common import load_config
    ns = argparse.Namespace(config=args.config, cfg_options=args.cfg_options,
                            launcher='none', local_rank=0,
                            work_dir=str(Path(args.work_dir) / spec.slug))
    cfg = load_config(ns)
    cls = backbone_class(cfg, args.config)
    defaults = inspect.signature(cls).parameters
    own = {key: cfg.model.backbone.get(key, defaults[key].default if key in defaults else None)
           for key in ('attn_design', 'kernel_size')}
    apply_spec(cfg, spec, cls)
    check_pretrained(cfg, spec, own)
    to_iterations(cfg, args.iters, args.val_interval or args.iters)
    cfg.randomness = dict(seed=args.seed, deterministic=True)
    cfg.experiment_name = spec.slug  # the Runner appends the time
    if not args.keep_checkpoints and cfg.get('default_hooks', {}).get('checkpoint'):
        cfg.default_hooks.checkpoint = None
    add_hooks(cfg, 'EmptyDatasetHook')
    return cfg


def to_iterations(cfg: Config, iters: int, val_interval: int) -> None:
    """An iteration-based loop of ``iters`` iterations. An epoch-based config
    (the ImageNet ones) keeps its schedule in iterations (its epoch-stepped
    schedulers converted, as ``convert_to_iter_based`` does) and logs by
    iteration, and checkpoints (``--keep-checkpoints``) at each evaluation; the
    schedule is cut at ``iters``, the same for every design."""
    train_cfg = cfg.get('train_cfg') or {}
    if train_cfg.get('type', 'IterBasedTrainLoop') != 'IterBasedTrainLoop' \
            or train_cfg.get('by_epoch'):
        schedulers = cfg.get('param_scheduler') or []
        for s in schedulers if isinstance(schedulers, (list, tuple)) else [schedulers]:
            if s.get('by_epoch', True):
                s['convert_to_iter_based'] = True
        cfg.log_processor = dict(cfg.get('log_processor') or {}, by_epoch=False)
        hooks = cfg.get('default_hooks') or {}
        if hooks.get('logger'):
            hooks.logger['log_metric_by_epoch'] = False
        if hooks.get('checkpoint'):  # its interval counted epochs: now each evaluation
            hooks.checkpoint.update(by_epoch=False, interval=val_interval)
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters, val_interval=val_interval)


class Timing(Hook):
    """Training and validation step times and the last evaluation's metrics.
    It runs first after each iteration; its :class:`StartClock` runs last
    before it, so other hooks' work (logging, schedulers) is not timed."""
    priority = 'VERY_HIGH'

    def __init__(self):
        self.t0, self.train_s, self.val_s_per_img, self.metrics = None, [], [], {}

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.train_s.append(time.perf_counter() - self.t0)

    def after_val_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.val_s_per_img.append((time.perf_counter() - self.t0) / max(len(outputs or ()), 1))

    def after_val_epoch(self, runner, metrics=None):
        self.metrics = dict(metrics or {})


class StartClock(Hook):
    """Starts :class:`Timing`'s clock, after every other hook's ``before_*_iter``."""
    priority = 'VERY_LOW'

    def __init__(self, timing: Timing):
        self.timing = timing

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.timing.t0 = time.perf_counter()

    def before_val_iter(self, runner, batch_idx, data_batch=None):
        self.timing.t0 = time.perf_counter()


def pick_metric(metrics: dict, wanted: str = None):
    if wanted:
        if wanted not in metrics:
            raise SystemExit(f'--metric {wanted!r} is not among the evaluator\'s '
                             f'{list(metrics)}')
        return wanted, metrics[wanted]
    if not metrics:
        return None, None
    key = next((k for k in metrics if k not in SIDE_METRICS), next(iter(metrics)))
    return key, metrics[key]


def count_model(cfg: Config, shape) -> dict:
    """Params and FLOPs (as get_flops.py) of a run's model."""
    import get_flops
    model, call = get_flops.model_of_config(cfg, shape)
    result = get_flops.count(model, call, shape)
    return dict(params_M=result['params'] / 1e6, flops_G=result['flops'] / 1e9)


def flops_shape(cfg: Config, shape) -> tuple:
    """``--shape``, else the size the model sees: the data preprocessor's
    ``size``, else the last crop or resize of the validation pipeline, else 224."""
    if shape:
        return tuple(shape) * (3 - len(shape))
    pre = cfg.model.get('data_preprocessor') or cfg.get('data_preprocessor') or {}
    size = pre.get('size')
    if not size:
        pipeline = cfg.get('val_dataloader', {}).get('dataset', {}).get('pipeline') or []
        sizes = [t.get('crop_size') or t.get('scale') for t in pipeline
                 if isinstance(t, dict) and (t.get('crop_size') or t.get('scale'))]
        size = sizes[-1] if sizes else 224
        if isinstance(size, (list, tuple)):
            size = tuple(size)[::-1]  # transforms take (w, h)
    return tuple(size) if isinstance(size, (list, tuple)) else (size, size)


def prepare(args) -> list:
    """Check every spec and build every model before any training."""
    import flatten_mm  # noqa: F401  (registers the backbones)
    try:
        specs = parse_specs(args.designs, known_designs())
    except ValueError as err:
        raise SystemExit(f'--designs: {err}')
    runs = []
    for spec in specs:
        cfg = run_config(args, spec)
        shape = flops_shape(cfg, args.shape)
        try:
            cost = count_model(cfg, shape)
        except (ValueError, TypeError) as err:
            raise SystemExit(f'design {spec.text!r}: the model does not build: {err}')
        print(f'{spec.text}: {cost["params_M"]:.2f} M params, {cost["flops_G"]:.3f} GFLOPs '
              f'at {shape[0]}x{shape[1]}', flush=True)
        runs.append((spec, cfg, dict(cost, shape=f'{shape[0]}x{shape[1]}')))
    return runs


def build_runner(cfg: Config):
    """mmengine's Runner of one run. ``randomness.deterministic=True`` turns on
    ``torch.use_deterministic_algorithms``, under which CUDA stops a run at its
    first cuBLAS product unless ``CUBLAS_WORKSPACE_CONFIG`` was set before it, and at
    any op without a deterministic kernel: the variable is set (if unset) and
    such ops warn instead (``warn_only``)."""
    import os
    import torch
    from mmengine.runner import Runner
    os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
    runner = Runner.from_cfg(cfg)
    if torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(True, warn_only=True)
    return runner


def train_one(spec: Spec, cfg: Config, cost: dict, metric: str = None) -> dict:
    runner = build_runner(cfg)
    timing = Timing()
    runner.register_hook(timing)
    runner.register_hook(StartClock(timing))
    runner.train()
    if not timing.metrics:  # no evaluation happened in training (no val loop)
        raise SystemExit(f'{spec.text}: the config has no validation (val_dataloader, '
                         'val_evaluator): nothing to compare')
    key, value = pick_metric(timing.metrics, metric)
    steps = timing.train_s[1:] or timing.train_s
    return dict(design=spec.text, attn_design=spec.design,
                knobs=json.dumps(spec.knobs) if spec.knobs else '', **cost,
                train_step_s=statistics.median(steps),
                infer_ms_per_img=1e3 * statistics.median(timing.val_s_per_img),
                metric=key, value=value, all_metrics=timing.metrics, work_dir=cfg.work_dir)


def fmt(value, spec):
    return '-' if value is None else format(value, spec)


def print_table(rows: List[dict]) -> str:
    metric = rows[0]['metric']
    lines = [f'| design | params (M) | FLOPs (G, {rows[0]["shape"]}) | train step (s) '
             f'| inference (ms/img) | {metric} |', '|---|---|---|---|---|---|']
    for r in rows:
        lines.append(f"| {r['design']} | {r['params_M']:.2f} | {r['flops_G']:.3f} | "
                     f"{r['train_step_s']:.3f} | {r['infer_ms_per_img']:.1f} | "
                     f"{fmt(r['value'], '.2f')} |")
    text = '\n'.join(lines)
    print(text)
    return text


def write_outputs(rows: List[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / 'results.json').write_text(json.dumps(rows, indent=1, default=float))
    with open(out / 'results.csv', 'w', newline='') as f:
        writer = csv.DictWriter(f, FIELDS + ['shape'], extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)
    try:
        plot(rows, out / 'results.png')
    except ImportError:
        print(f'matplotlib is not installed: no plot (the numbers are in {out}/results.csv)')


def plot(rows: List[dict], path: Path) -> None:
    """Metric against training step time and against FLOPs, one point per design."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (key, label) in zip(axes, [('train_step_s', 'training step (s)'),
                                       ('flops_G', f'GFLOPs at {rows[0]["shape"]}')]):
        for i, r in enumerate(rows):
            if r['value'] is not None:
                ax.plot(r[key], r['value'], 'o', color=f'C{i % 10}', label=r['design'])
                ax.annotate(r['design'], (r[key], r['value']), fontsize=7,
                            textcoords='offset points', xytext=(4, 4))
        ax.set(xlabel=label, ylabel=rows[0]['metric'])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle('attention designs')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f'plot: {path}')


def main(argv=None):
    parser, args = parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    runs = prepare(args)
    rows = []
    for spec, cfg, cost in runs:
        print(f'=== {spec.text}: training {args.iters} iterations in {cfg.work_dir}', flush=True)
        rows.append(train_one(spec, cfg, cost, args.metric))
        write_outputs(rows, Path(args.work_dir))  # after each run: a later failure keeps it
    print_table(rows)
    print(f'table: {Path(args.work_dir) / "results.csv"}')
    return rows


if __name__ == '__main__':
    main()
