"""tools/analysis_tools/kernel_resources.py: the attention core's Triton kernels
built for an H100/H200 (sm_90), an A100 (sm_80) and Blackwell GPUs (sm_100,
sm_120) by triton's compiler and ptxas, without a GPU.

The interpreter (which runs the kernels' arithmetic in the other tests) never
builds them; this does, with the GPU's tiling, and holds each kernel to no
register spills and to the shared memory a program may have."""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TOOL = osp.join(ROOT, 'tools', 'analysis_tools', 'kernel_resources.py')
# the most shared memory one block may take (opt-in), by architecture
SHARED_PER_PROGRAM = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024, 103: 227 * 1024,
                      120: 99 * 1024}
# the state's chunks summed between the passes (KV and km; their gradients)
FORWARD = ['_kv_state_kernel', '_state_sum_kernel', '_output_kernel']
# several heads: row statistics of q and k, and two backward passes a side;
# one head: the token kernels make the statistics, and one pass a side
# (s_inv = 1 / softplus(scale) first, by a one-program kernel)
HEADS = ['_inverse_scale_kernel'] + ['_row_stats_kernel'] * 2 + FORWARD + [
    '_query_state_grad_kernel', '_query_grad_kernel', '_state_sum_kernel',
    '_key_value_grad_kernel', '_key_grad_kernel']
ONE_HEAD = ['_inverse_scale_kernel'] + FORWARD + ['_query_grad_kernel', '_state_sum_kernel',
                                                  '_key_grad_kernel']
# on GPUs with only the warp-level MMA (sm_80-89, sm_120) the one-head query side
# keeps its two passes (fused, it spilled)
ONE_HEAD_SM80 = ['_inverse_scale_kernel'] + FORWARD + [
    '_query_state_grad_kernel', '_query_grad_kernel', '_state_sum_kernel', '_key_grad_kernel']
# the fused out + DWC(V): forward, V's gradient (the same kernel), weight gradient (a
# sweep, then the chunks summed into the kernel's parts)
CONV = ['_conv_add_kernel'] * 3 + ['_conv_weight_grad_kernel', '_conv_grad_sum_kernel']
# kernels without a dot: per-row reductions and the depth-wise conv
NO_DOT = {'_row_stats_kernel', '_conv_add_kernel', '_conv_weight_grad_kernel',
          '_state_sum_kernel', '_inverse_scale_kernel', '_conv_grad_sum_kernel'}


def nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return os.path.exists(get_ptxas(90).path)
    except Exception:  # noqa: BLE001 (no triton, or one without the NVIDIA backend)
        return False


def build(tmp_path, arch, *args):
    out = tmp_path / 'rows.json'
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    proc = subprocess.run([sys.executable, TOOL, '--arch', str(arch), *args, '--json', str(out)],
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    import triton
    assert {(row['arch'], row['triton']) for row in rows} == {(arch, triton.__version__)}
    from flatten_mm.models.ops.triton_kernels import fuses_query_passes
    by_case = {}
    for row in rows:
        by_case.setdefault((row['case'], row['dtype']), []).append(row)
    for (case, dtype), built in by_case.items():
        names = [row['kernel'] for row in built]
        one_head = ONE_HEAD if fuses_query_passes(divmod(arch, 10)) else ONE_HEAD_SM80
        assert names == (one_head if case.endswith('x1') else HEADS) + CONV, (case, dtype)
    for row in rows:
        assert row['spill_stores'] == row['spill_loads'] == 0, row
        assert row['shared'] <= SHARED_PER_PROGRAM[arch], row
        # every kernel with a dot or a reduction stages through shared memory
        # (but the conv, the chunk sums and the scale: element-wise loads and adds;
        # the conv's sum over heads, with one head none)
        assert row['shared'] > 0 or row['kernel'] in (
            '_conv_add_kernel', '_state_sum_kernel', '_inverse_scale_kernel',
            '_conv_grad_sum_kernel'), row
        assert row['num_warps'] == 8, row
        # the looping kernels real sizes run, not the loop-free ones triton
        # builds for one block per program (an argument equal to 1 is a constant)
        assert row['blocks_per_prog'] is None or row['blocks_per_prog'] >= 2, row
        # every dot on tensor cores (bf16; fp16 and TF32: tf32), none for IEEE fp32
        tensor_core = row['wgmma'] + row['mma_sync'] + row['tcgen05'] > 0
        ieee = row['dtype'] == 'fp32' and '--tf32' not in args
        assert tensor_core == (row['kernel'] not in NO_DOT and not ieee), row
    return by_case


@pytest.mark.skipif(not nvidia_backend(), reason='triton without its NVIDIA backend and ptxas')
@pytest.mark.heavy(21)
def test_every_kernel_builds_for_sm90_without_spills(tmp_path):
    by_case = build(tmp_path, 90, '--dtypes', 'bf16', 'fp16', 'fp32')
    assert len(by_case) == 4 * 3  # the default cases, three dtypes
    # built with the GPU's tiling, not the interpreter's 16-token blocks
    swin = {r['kernel']: r['constexprs'] for r in by_case[('32x3m', 'bf16')]}
    assert swin['_kv_state_kernel']['BLOCK_N'] == '128'
    assert swin['_query_grad_kernel']['BLOCK_N'] == '64'  # backward: half blocks
    assert swin['_kv_state_kernel']['DOT_DTYPE'] == 'bf16'
    assert swin['_kv_state_kernel']['HAS_MASK'] == 'True'
    pvt = {r['kernel']: r['constexprs'] for r in by_case[('64x1', 'fp32')]}
    assert pvt['_output_kernel']['PREC'] == 'ieee'
    assert pvt['_query_grad_kernel']['WHOLE_ROWS'] == pvt['_key_grad_kernel']['WHOLE_ROWS'] == 'True'
    assert swin['_conv_add_kernel']['BLOCK_C'] == '32'  # C = 96: three blocks, none padded
    assert pvt['_conv_weight_grad_kernel']['TAPS'] == '32'  # 25 taps and the bias


@pytest.mark.skipif(not nvidia_backend(), reason='triton without its NVIDIA backend and ptxas')
def test_fp32_kernels_with_tf32_allowed_build_without_spills(tmp_path):
    """fp32 with TF32 allowed takes tensor-core dots and larger blocks than IEEE."""
    by_case = build(tmp_path, 90, '--dtypes', 'fp32', '--tf32', '--cases', '32x3m', '64x1')
    swin = {r['kernel']: r['constexprs'] for r in by_case[('32x3m', 'fp32')]}
    assert swin['_kv_state_kernel']['PREC'] == 'tf32'
    assert swin['_kv_state_kernel']['BLOCK_N'] == '128'  # IEEE: 1024 / 32 = 32


@pytest.mark.skipif(not nvidia_backend(), reason='triton without its NVIDIA backend and ptxas')
def test_bf16_kernels_build_for_sm80_without_spills(tmp_path):
    """A100s: where a fused one-head query pass spilled (224 bytes at d = 64)."""
    assert len(build(tmp_path, 80, '--dtypes', 'bf16')) == 4


@pytest.mark.skipif(not nvidia_backend(), reason='triton without its NVIDIA backend and ptxas')
@pytest.mark.parametrize('arch', [100, 120])
def test_bf16_kernels_build_for_blackwell_without_spills(tmp_path, arch):
    """B200 (sm_100: tcgen05 dots) and the RTX 50 series (sm_120: warp-level
    dots, where the fused one-head query pass spilled 212 bytes at d = 64).
    fp16 builds as bf16 but for the dots' type, and the B300 (sm_103) as the
    B200: those builds are left to the tool (docs/tests.md), to keep the suite
    short (a build without triton's cache takes 6 s a case and dtype)."""
    by_case = build(tmp_path, arch, '--dtypes', 'bf16')
    assert len(by_case) == 4
    # every dot on tensor cores (build): on sm_100 the 64-wide products take
    # Blackwell's MMA; sm_120 has only the warp-level one
    tcgen05 = {(r['case'], r['kernel']) for rows in by_case.values() for r in rows
               if r['tcgen05']}
    assert (('64x1', '_output_kernel') in tcgen05) == (arch < 120), sorted(tcgen05)
    assert bool(tcgen05) == (arch < 120), sorted(tcgen05)
