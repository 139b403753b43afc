"""Time each stage of two Swin backbones side by side, in one process.

    python tools/analysis_tools/benchmark_stages.py --models flatten-swin-t swin-t \\
        --size 800x1333 --mode fwdbwd --rounds 6 --threads 2

Both models are built in this process (``benchmark_backbone.py``'s names:
``flatten-swin-{t,s}`` and mmdet's ``swin-{t,s}``). For every stage, the
stage's blocks run on a random (1, N, C) input of that stage's grid (the grid
the image size gives after the 4x4 patch embedding and each 2x2 merging):
forward under ``no_grad`` in eval mode, or forward + backward of the mean in
training mode. The models alternate step by step, the order flipped every
round, so every ratio is taken between neighbouring steps. Printed per stage:
both medians, the median and range of the step ratios, and each stage's share
of the first model's total. ``--part attention`` times only each block's
attention half (LayerNorm, attention with its projections, drop path and
residual), leaving out the MLP half the two models share.
"""
import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_backbone import build_model, check_model_names, parse_size  # noqa: E402


SWIN_PREFIXES = ('flatten-swin-', 'swin-')


def stage_blocks(name: str, model) -> list:
    """The blocks of each stage, as lists of modules called ``block(x, hw_shape)``."""
    stages = model.layers if name.startswith('flatten-swin-') else model.stages  # mmdet's
    return [list(stage.blocks) for stage in stages]


def stage_grids(size, stages: int) -> list:
    """(H, W) of each stage: 4x4 patches, then 2x2 merging, odd sides padded."""
    h, w = math.ceil(size[0] / 4), math.ceil(size[1] / 4)
    grids = []
    for _ in range(stages):
        grids.append((h, w))
        h, w = math.ceil(h / 2), math.ceil(w / 2)
    return grids


def attention_half(block, x, grid):
    """x + attention(norm1(x)) of one block, with its drop path: flatten_mm's
    SwinBlock (``attention``) or mmdet's (``attn``, drop path inside)."""
    if hasattr(block, 'attention'):
        return block.drop_path(block.attention(block.norm1(x), grid), x)
    return block.attn(block.norm1(x), grid) + x


def time_stage(torch, blocks, grid, train: bool, part: str = 'block') -> float:
    """Seconds for the blocks (or their attention halves) on one fresh random
    input of the stage's shape."""
    C = blocks[0].norm1.normalized_shape[0]
    x = torch.randn(1, grid[0] * grid[1], C, requires_grad=train)
    t0 = time.perf_counter()
    with torch.set_grad_enabled(train):
        for block in blocks:
            x = block(x, grid) if part == 'block' else attention_half(block, x, grid)
        if train:
            x.mean().backward()
    return time.perf_counter() - t0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs=2, default=['flatten-swin-t', 'swin-t'],
                        metavar='MODEL', help='two Swin models; ratios are first / second')
    parser.add_argument('--size', type=parse_size, default=[800, 1333])
    parser.add_argument('--mode', choices=['fwd', 'fwdbwd'], default='fwdbwd')
    parser.add_argument('--rounds', type=int, default=6)
    parser.add_argument('--part', choices=['block', 'attention'], default='block',
                        help="whole blocks, or only their attention halves")
    parser.add_argument('--threads', type=int, default=2)
    args = parser.parse_args(argv)
    check_model_names(parser, args.models)
    for name in args.models:
        if not name.startswith(SWIN_PREFIXES):
            parser.error(f'benchmark_stages takes Swin models (flatten-swin-*, swin-*), '
                         f'got {name!r}')
    if args.rounds < 1:
        parser.error(f'--rounds must be >= 1, got {args.rounds}')
    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    train = args.mode == 'fwdbwd'
    models = [build_model(name) for name in args.models]
    blocks = []
    for name, model in zip(args.models, models):
        model.train(train)
        blocks.append(stage_blocks(name, model))
    grids = stage_grids(args.size, len(blocks[0]))
    times = [[[] for _ in grids] for _ in models]  # [model][stage] -> seconds
    for r in range(args.rounds + 1):  # round 0 warms up
        for s, grid in enumerate(grids):
            order = [0, 1] if r % 2 else [1, 0]
            for m in order:
                t = time_stage(torch, blocks[m][s], grid, train, args.part)
                models[m].zero_grad(set_to_none=True)
                if r:
                    times[m][s].append(t)
    a, b = args.models
    print(f'| stage | grid | {a} (ms) | {b} (ms) | x {b} (range) | share of {a} |')
    print('|---|---|---|---|---|---|')
    rows = []
    total = sum(statistics.median(t) for t in times[0])
    for s, grid in enumerate(grids):
        ratios = sorted(x / y for x, y in zip(times[0][s], times[1][s]))
        row = dict(stage=s + 1, grid=grid, ms=[1000 * statistics.median(times[m][s]) for m in (0, 1)],
                   ratio=statistics.median(ratios), range=(ratios[0], ratios[-1]))
        rows.append(row)
        print(f"| {s + 1} | {grid[0]}x{grid[1]} | {row['ms'][0]:.0f} | {row['ms'][1]:.0f} | "
              f"{row['ratio']:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
              f"{row['ms'][0] / 1000 / total:.2f} |")
    sums = [sum(r['ms'][m] for r in rows) for m in (0, 1)]
    print(f'| all | | {sums[0]:.0f} | {sums[1]:.0f} | {sums[0] / sums[1]:.2f} (of the medians) | 1 |')
    return rows


if __name__ == '__main__':
    main()
