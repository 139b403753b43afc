"""The linear-attention designs FLatten compares itself with (its Figure 2), as
options of :class:`~flatten_mm.models.attention.FocusedLinearAttention`.

Each design is a reference formula of the projected q (B, N, C), k and v
(B, n, C) over all tokens, with an optional key mask (B, n) (False: the key
takes no part), plus a small :class:`Design` object that says which
parameters the layer holds for it and how the layer calls it. The layer's
projections, positional encoding (added to k) and output projection are the
same for every design; the DWC on V is the focused and angular designs' own.
docs/attention_designs.md has the formulas, costs and the choices made where
a paper leaves something open.

* ``focused``: FLatten (the default): the dispatching core op
  :func:`~flatten_mm.models.ops.focused_linear_attention` + DWC(V).
* ``relu``: :func:`relu_attention` (Katharopoulos et al. 2020 with phi = ReLU).
* ``efficient``: :func:`efficient_attention` (Shen et al. 2021).
* ``hydra``: :func:`hydra_attention` (Bolya et al. 2022).
* ``angular``: :func:`angular_attention` (Castling-ViT, You et al. 2023) + DWC(V).
* ``efficientvit``: :func:`efficientvit_attention` (EfficientViT, Cai et al. 2023).
"""
import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import EPS, focused_linear_attention, in_fp32
from .utils import HWShape, hooked, must_call

#: EfficientViT's normaliser epsilon (its LiteMLA's default)
EFFICIENTVIT_EPS = 1e-15
#: EfficientViT's aggregation kernel (its ``scales=(5,)``)
EFFICIENTVIT_SCALE = 5


def check_design(value, name: str = 'design') -> str:
    """``value`` if it names a design, else a ValueError naming it and the designs."""
    if not isinstance(value, str) or value not in DESIGNS:
        raise ValueError(f'{name} must be one of {tuple(DESIGNS)}, got {value!r}')
    return value


def check_kernel_size(value) -> int:
    """The DWC's kernel: 0 (no DWC) or a positive odd int, else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or \
            (value and value % 2 == 0):
        raise ValueError('kernel_size must be odd (the DWC keeps the grid size) and positive, '
                         f'or 0 for no DWC; got {value!r}')
    return value


def _heads(x: Tensor, num_heads: int) -> Tensor:
    """(B, N, C) -> (B, h, N, d), a view."""
    B, N, C = x.shape
    return x.view(B, N, num_heads, C // num_heads).transpose(1, 2)


def _merge_heads(x: Tensor) -> Tensor:
    """(B, h, N, d) -> (B, N, h * d)."""
    B, h, N, d = x.shape
    return x.transpose(1, 2).reshape(B, N, h * d)


def _key_weights(k: Tensor, key_mask: Optional[Tensor]) -> Tensor:
    """(B, 1, n, 1): 1 for real keys, 0 for masked ones (1 everywhere without a mask)."""
    if key_mask is None:
        return k.new_ones(k.shape[0], 1, k.shape[1], 1)
    return key_mask.to(k.dtype).view(k.shape[0], 1, k.shape[1], 1)


def normalized_linear_attention(fq: Tensor, fk: Tensor, v: Tensor,
                                key_mask: Optional[Tensor], eps: float) -> Tensor:
    """``out_i = sum_j (fq_i . fk_j) v_j / (sum_j fq_i . fk_j + eps)`` per head
    over the real keys, in linear form: ``fK^T [V, 1]`` then ``fQ`` times it
    (the ones column gives the normaliser in the same product).

    Args:
        fq (Tensor): (B, h, N, e) query features.
        fk (Tensor): (B, h, n, e) key features.
        v (Tensor): (B, h, n, d) values.

    Returns:
        Tensor: (B, h, N, d).
    """
    d = v.shape[-1]
    v1 = F.pad(v, (0, 1), value=1.0) * _key_weights(v[:, 0], key_mask)
    out = fq @ (fk.transpose(-2, -1) @ v1)
    return out[..., :d] / (out[..., d:] + eps)


def _relu(q: Tensor, k: Tensor, v: Tensor, num_heads: int, key_mask: Optional[Tensor],
          eps: float) -> Tensor:
    h = num_heads
    out = normalized_linear_attention(_heads(F.relu(q), h), _heads(F.relu(k), h),
                                      _heads(v, h), key_mask, eps)
    return _merge_heads(out)


def relu_attention(q: Tensor, k: Tensor, v: Tensor, num_heads: int,
                   key_mask: Optional[Tensor] = None, eps: float = EPS) -> Tensor:
    """ReLU linear attention (Katharopoulos et al. 2020, phi = ReLU), per head:
    ``out_i = phi(q_i) sum_j phi(k_j)^T v_j / (phi(q_i) . sum_j phi(k_j) + eps)``
    over the real keys. (B, N, C)."""
    return in_fp32(_relu, q, k, v, num_heads, key_mask, eps)


def _efficient(q: Tensor, k: Tensor, v: Tensor, num_heads: int,
               key_mask: Optional[Tensor]) -> Tensor:
    rho_q = _heads(q, num_heads).softmax(dim=-1)
    logits = _heads(k, num_heads)
    if key_mask is not None:
        logits = logits.masked_fill(_key_weights(k, key_mask) == 0, float('-inf'))
    rho_k = logits.softmax(dim=-2)
    return _merge_heads(rho_q @ (rho_k.transpose(-2, -1) @ _heads(v, num_heads)))


def efficient_attention(q: Tensor, k: Tensor, v: Tensor, num_heads: int,
                        key_mask: Optional[Tensor] = None) -> Tensor:
    """Efficient Attention (Shen et al. 2021), per head:
    ``rho_q(Q) (rho_k(K)^T V)`` with rho_q a softmax of each query over its d
    channels and rho_k a softmax of each key channel over the (real) keys; no
    1/sqrt(d) scaling (as the paper). (B, N, C)."""
    return in_fp32(_efficient, q, k, v, num_heads, key_mask)


def _hydra(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor]) -> Tensor:
    q = F.normalize(q, dim=-1)
    k = F.normalize(k, dim=-1)
    if key_mask is not None:
        k = k * key_mask.to(k.dtype).unsqueeze(-1)
    # sum_j k_j * v_j per channel, as (B, C) dot products over the keys: a matmul,
    # as FLOP counters count one (ONNX has Einsum from opset 12 only)
    kv = torch.matmul(k.transpose(1, 2).unsqueeze(2), v.transpose(1, 2).unsqueeze(3))
    kv = kv.flatten(1)  # (B, C)
    return q * kv.unsqueeze(1)


def hydra_attention(q: Tensor, k: Tensor, v: Tensor, num_heads: int = 0,
                    key_mask: Optional[Tensor] = None) -> Tensor:
    """Hydra Attention (Bolya et al. 2022): as many heads as channels, q and
    k L2-normalised over all C channels (cosine similarity), and
    ``out_i = q^_i * sum_j k^_j * v_j`` (element-wise) over the real keys;
    unnormalised, as the paper. ``num_heads`` is not used (it is C). (B, N, C)."""
    return in_fp32(_hydra, q, k, v, key_mask)


def _angular(q: Tensor, k: Tensor, v: Tensor, num_heads: int,
             key_mask: Optional[Tensor]) -> Tensor:
    qh = F.normalize(_heads(q, num_heads), dim=-1)
    kh = F.normalize(_heads(k, num_heads), dim=-1)
    # s_ij = 1/2 + q^_i . k^_j / pi = [q^_i / pi, 1] . [k^_j, 1/2]
    fq = F.pad(qh / math.pi, (0, 1), value=1.0)
    fk = F.pad(kh, (0, 1), value=0.5)
    return _merge_heads(normalized_linear_attention(fq, fk, _heads(v, num_heads), key_mask, EPS))


def angular_attention(q: Tensor, k: Tensor, v: Tensor, num_heads: int,
                      key_mask: Optional[Tensor] = None) -> Tensor:
    """Castling-ViT's linear-angular attention (You et al. 2023), per head:
    the angular kernel ``1 - arccos(q^ . k^) / pi`` of L2-normalised q and k
    kept to its linear term, ``s_ij = 1/2 + (q^_i . k^_j) / pi`` (always >= 1/2
    - 1/pi > 0), and ``out_i = sum_j s_ij v_j / (sum_j s_ij + eps)`` over the
    real keys: the similarity matrix normalised by its row sums, as every
    kernel attention here. (The paper's released code instead adds ``v_i / 2``
    and L2-normalises each output row; we keep the kernel's own row
    normalisation, so a row's weights sum to 1.) The DWC on V is the layer's.
    (B, N, C)."""
    return in_fp32(_angular, q, k, v, num_heads, key_mask)


def efficientvit_attention(q: Tensor, k: Tensor, v: Tensor, num_heads: int,
                           key_mask: Optional[Tensor] = None) -> Tensor:
    """EfficientViT's ReLU linear attention at one scale (its LiteMLA's
    ``relu_linear_att``): :func:`relu_attention` with EfficientViT's
    ``eps = 1e-15``. The multi-scale aggregation and the concatenation are
    :class:`EfficientViTDesign`'s. (B, N, C)."""
    return relu_attention(q, k, v, num_heads, key_mask, EFFICIENTVIT_EPS)


class Design:
    """One attention design of the layer: its formula and what it owns.

    ``dwc`` says whether the layer's depth-wise conv on V (``kernel_size``,
    0 for none) is part of the design. ``add_parameters`` registers the
    design's own parameters on the layer (under the layer's names, so the
    focused design's state-dict keys are the release's). ``attend`` computes
    the attention term of the projected q, k, v; ``flops`` counts it per
    image, as :mod:`flatten_mm.analysis` does (one multiply-accumulate of a
    product is one FLOP; element-wise work counts nothing).
    """
    name = ''
    dwc = False
    formula: Callable[..., Tensor] = staticmethod(relu_attention)

    def add_parameters(self, layer: nn.Module) -> None:
        pass

    def attend(self, layer: nn.Module, q: Tensor, k: Tensor, v: Tensor,
               key_mask: Optional[Tensor], overwrite_qk: bool,
               grids: Optional[Tuple[HWShape, HWShape]]) -> Tensor:
        return self.formula(q, k, v, layer.num_heads, key_mask)

    def flops(self, N: int, n: int, C: int, num_heads: int) -> int:
        d = C // num_heads
        return (n + N) * C * (d + 1)  # fK^T [V, 1] and fQ times it

    def __repr__(self) -> str:
        return self.name


class FocusedDesign(Design):
    """FLatten: the focused mapping with its learnable ``scale``, the fast
    dispatching core op, DWC(V)."""
    name, dwc = 'focused', True

    def add_parameters(self, layer: nn.Module) -> None:
        layer.scale = nn.Parameter(torch.zeros(1, 1, layer.embed_dims))

    def attend(self, layer, q, k, v, key_mask, overwrite_qk, grids):
        return focused_linear_attention(q, k, v, layer.scale, layer.focusing_factor,
                                        layer.num_heads, key_mask, overwrite_qk)

    def flops(self, N, n, C, num_heads):
        d = C // num_heads
        return n * C * d + n * C + N * C + N * C * d


class ReluDesign(Design):
    name, formula = 'relu', staticmethod(relu_attention)


class EfficientDesign(Design):
    name, formula = 'efficient', staticmethod(efficient_attention)

    def flops(self, N, n, C, num_heads):
        return (n + N) * C * (C // num_heads)


class HydraDesign(Design):
    name, formula = 'hydra', staticmethod(hydra_attention)

    def flops(self, N, n, C, num_heads):
        return n * C  # sum_j k^_j * v_j; the product with q^ is element-wise


class AngularDesign(Design):
    name, dwc, formula = 'angular', True, staticmethod(angular_attention)

    def flops(self, N, n, C, num_heads):
        return (n + N) * num_heads * (C // num_heads + 1) ** 2


class EfficientViTDesign(Design):
    """EfficientViT's multi-scale linear attention: q, k and v each also
    aggregated by a 5x5 depth-wise conv and a group-wise 1x1 conv (one group
    per head of q, k or v; both without bias, as EfficientViT), ReLU linear
    attention at both scales (the aggregated tokens as further heads), the
    two outputs concatenated (2C channels) into the layer's ``proj``, which
    here maps 2C -> C. The aggregation runs on each grid through the layer's
    :meth:`conv_on_grid`; masked (padding) tokens are zeroed first, as the
    conv's own zero padding at the map border. Prefix (class) tokens are
    zeros at the aggregated scale."""
    name, formula = 'efficientvit', staticmethod(efficientvit_attention)

    def add_parameters(self, layer: nn.Module) -> None:
        C3 = 3 * layer.embed_dims
        layer.aggreg = nn.Sequential(
            nn.Conv2d(C3, C3, EFFICIENTVIT_SCALE, padding=EFFICIENTVIT_SCALE // 2, groups=C3,
                      bias=False),
            nn.Conv2d(C3, C3, 1, groups=3 * layer.num_heads, bias=False))
        proj = layer.proj
        layer.proj = nn.Linear(2 * layer.embed_dims, layer.embed_dims, bias=proj.bias is not None)

    def aggregate(self, layer: nn.Module, x: Tensor, grid: HWShape, parts: slice) -> Tensor:
        """The ``parts`` (channels: q 0..C, k C..2C, v 2C..3C of the aggregation)
        of x (B, P + n, channels) after the aggregation convs, on ``grid``. Both
        convs keep the parts apart (depth-wise; 1x1 in groups within a part), so
        each runs on its own rows of the weights; where ``aggreg`` must be
        called (an adapter, a hook: :func:`~flatten_mm.models.utils.must_call`)
        it runs once on the 3C map, zeros in the parts x does not hold."""
        C, (dw, pw) = layer.embed_dims, layer.aggreg

        def conv(m: Tensor) -> Tensor:
            if must_call(dw, pw) or hooked(layer.aggreg):
                full = F.pad(m, (0, 0, 0, 0, parts.start, 3 * C - parts.stop))
                return layer.aggreg(full)[:, parts]
            m = F.conv2d(m, dw.weight[parts], None, padding=dw.padding, groups=m.shape[1])
            return F.conv2d(m, pw.weight[parts], None, groups=m.shape[1] // layer.head_dims)
        P = getattr(layer, 'num_prefix_tokens', 0)
        if not P:
            return layer.conv_on_grid(x, grid, conv)
        # prefix (class) tokens have no place on the grid: zeros at the aggregated
        # scale, so they take no part in it (as they get no DWC term)
        return F.pad(layer.conv_on_grid(x[:, P:], grid, conv), (0, 0, P, 0))

    def attend(self, layer, q, k, v, key_mask, overwrite_qk, grids):
        if grids is None:
            raise ValueError("attn design 'efficientvit' needs the grids (hw_shape and the "
                             'key grid) for its multi-scale aggregation, got grids=None')
        hw_shape, grid = grids
        if key_mask is not None:  # padding as zeros, as at the map border
            m = key_mask.to(q.dtype).unsqueeze(-1)
            q, k, v = q * m, k * m, v * m
        C = layer.embed_dims
        if layer.sr_ratio == 1:  # one map of q, k, v, as EfficientViT's
            agg = self.aggregate(layer, torch.cat([q, k, v], -1), grid, slice(0, 3 * C))
            q2, k2, v2 = agg.split(C, -1)
        else:  # q on the query grid, k and v on the reduced one
            q2 = self.aggregate(layer, q, hw_shape, slice(0, C))
            k2, v2 = self.aggregate(layer, torch.cat([k, v], -1), grid,
                                    slice(C, 3 * C)).split(C, -1)
        return torch.cat([efficientvit_attention(*s, layer.num_heads, key_mask)
                          for s in ((q, k, v), (q2, k2, v2))], dim=-1)

    def flops(self, N, n, C, num_heads):
        return 2 * super().flops(N, n, C, num_heads)  # the convs count as convs


DESIGNS: Dict[str, Design] = {d.name: d for d in (
    FocusedDesign(), ReluDesign(), EfficientDesign(), HydraDesign(), AngularDesign(),
    EfficientViTDesign())}


def get_design(name: str) -> Design:
    """The :class:`Design` called ``name`` (ValueError listing them otherwise)."""
    return DESIGNS[check_design(name)]


def local_kernel(layer: nn.Module) -> Optional[Tuple[Tensor, Tensor, Optional[tuple]]]:
    """The layer's depth-wise conv on V over all C channels as
    :func:`~flatten_mm.models.ops.depthwise_conv_add` takes it, in parts: its
    DWC's (d, 1, K, K) kernel and (d,) bias (``dwc``, one kernel for every
    head), and CSwin's LePE (``get_v``) as the extra (weight, bias) (None
    without); LePE alone where there is no DWC. None when it has neither
    (``kernel_size=0``, or a design without DWC, and no LePE)."""
    dwc, lepe = getattr(layer, 'dwc', None), getattr(layer, 'get_v', None)
    if dwc is None:
        return None if lepe is None else (lepe.weight, lepe.bias, None)
    return dwc.weight, dwc.bias, None if lepe is None else (lepe.weight, lepe.bias)
