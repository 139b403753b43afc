"""Loading checkpoints safely.

Checkpoints written by the FLatten training script hold ``{'model':
state_dict}`` and may also hold optimizer state and pickled objects (a yacs
config, argparse namespaces, numpy scalars). ``torch.load(weights_only=True)``
refuses those, and ``weights_only=False`` would run whatever the pickle says.

:func:`load_state_dict_file` reads such files with torch's weights-only
unpickler, standing in an inert placeholder for each foreign class: the
placeholder absorbs the object's data and runs none of its code. Tensors come
out intact; anything that is not a tensor of the state dict is dropped.
"""
import hashlib
import importlib
import os
import pickle
import re
import types
import urllib.parse
from typing import Dict, Iterable, Optional

import torch
from mmengine.logging import print_log
from torch import nn

# Where checkpoints nest the weights, in order of preference: the release's
# ``'model'`` (what its evaluation command, ``main.py --eval --resume``, loads;
# its EMA training script saves the EMA weights beside them), mmengine's
# ``'state_dict'``, ``'model_ema'``, ``'module'``, and last the release's EMA
# entry, for files that hold only it. timm's own loader prefers EMA weights.
STATE_DICT_KEYS = ('model', 'state_dict', 'model_ema', 'module', 'state_dict_ema')
# Data types that training scripts pickle beside the weights and that are
# rebuilt for real: numpy arrays and scalars, and what mmengine stores in its
# checkpoints (message-hub history buffers, configs). None of them runs code
# when rebuilt.
REAL_GLOBALS = (
    r'numpy\.(_core|core)\.multiarray\.(_reconstruct|scalar)$',
    r'numpy\.(ndarray|dtype)$',
    r'numpy\.dtypes\.\w+DType$',
    r'mmengine\.logging\.history_buffer\.HistoryBuffer$',
    r'mmengine\.config\.config\.ConfigDict$',
    r'collections\.(OrderedDict|defaultdict)$',
    r'builtins\.(set|frozenset|slice)$',
)
# The only attributes a pickle may look up (pickle's ``getattr``): the
# statistics methods mmengine's HistoryBuffer pickles in its state. Methods of
# the data types above are not data: ``numpy.ndarray.tofile`` writes a file.
REAL_ATTRIBUTES = {
    'mmengine.logging.history_buffer.HistoryBuffer': ('min', 'max', 'current', 'mean'),
}
# Foreign types read as inert placeholders (their code is not run).
TOLERATED_GLOBALS = (
    r'yacs\.config\.CfgNode$',
    r'argparse\.Namespace$',
)


class ForeignObject(dict):
    """Inert stand-in for a pickled object of a class we do not trust.

    It accepts any constructor arguments and state and keeps them as data.
    """

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.args = args
        self.kwargs = kwargs

    def __setstate__(self, state):
        self.__dict__['state'] = state


def _torch_safe_globals() -> dict:
    """What torch's own weights-only unpickler accepts ('module.name' -> object)."""
    from torch import _weights_only_unpickler as wou
    allowed = dict(wou._get_allowed_globals())
    allowed.update(wou._get_user_allowed_globals())
    return allowed


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global that may run code."""


def _matches_any(name: str, patterns) -> bool:
    return any(re.match(p, name) for p in patterns)


def _allowed_names() -> str:
    return ', '.join(p.rstrip('$').replace('\\', '')
                     for p in REAL_GLOBALS + TOLERATED_GLOBALS)


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves torch's safe globals, the data types of ``REAL_GLOBALS`` and,
    for ``TOLERATED_GLOBALS``, inert placeholders; anything else stops the load.

    ``getattr`` (pickle's way to name a class attribute, e.g. the statistics
    methods mmengine's HistoryBuffer keeps) is allowed for ``REAL_ATTRIBUTES`` only.
    """
    placeholders: set
    safe_globals: dict

    def find_class(self, module: str, name: str):
        full = f'{module}.{name}'
        safe = self.safe_globals.get(full)
        if safe is not None:
            return safe
        if _matches_any(full, REAL_GLOBALS):
            return getattr(importlib.import_module(module), name)
        if full in ('builtins.getattr', '__builtin__.getattr'):
            return _guarded_getattr
        if _matches_any(full, TOLERATED_GLOBALS):
            self.placeholders.add(full)
            return type(name, (ForeignObject,), {})
        raise RefusedGlobal(
            f'the pickle refers to {full}, which a checkpoint has no reason to '
            'hold (it could run code). Only tensors, plain containers and these '
            f'stored types are accepted: {_allowed_names()}')


def _guarded_getattr(obj, name: str):
    owner = obj if isinstance(obj, type) else type(obj)
    full = f'{owner.__module__}.{owner.__qualname__}'
    if name not in REAL_ATTRIBUTES.get(full, ()):
        raise RefusedGlobal(f'the pickle asks for {full}.{name}, which a checkpoint '
                            'has no reason to hold (it could run code)')
    return getattr(obj, name)


def _restricted_pickle_module():
    module = types.ModuleType('flatten_mm_restricted_pickle')
    module.__dict__.update({k: getattr(pickle, k) for k in ('load', 'loads', 'UnpicklingError')})
    placeholders = set()

    class Unpickler(_RestrictedUnpickler):
        pass
    Unpickler.placeholders = placeholders
    Unpickler.safe_globals = _torch_safe_globals()
    module.Unpickler = Unpickler
    module.placeholders = placeholders
    return module


def load_checkpoint_file(path: str, map_location='cpu') -> dict:
    """Read a checkpoint without executing pickled code.

    Files torch's weights-only load accepts are read that way. Others are
    read by a restricted unpickler: torch's safe globals resolve as usual,
    the stored types of ``TOLERATED_GLOBALS`` become inert placeholders, and
    any other global refuses the file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a torch checkpoint, or it refers to code.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint file not found: {path}')
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        pass
    except Exception as err:
        raise ValueError(f'{path}: not a readable torch checkpoint ({err})') from err
    module = _restricted_pickle_module()
    try:
        obj = torch.load(path, map_location=map_location, weights_only=False,
                         pickle_module=module)
    except RefusedGlobal as err:
        raise ValueError(f'{path}: refused to load: {err}') from None
    except Exception as err:
        raise ValueError(f'{path}: not a readable torch checkpoint ({err})') from err
    if module.placeholders:
        print_log(f'{path}: ignored pickled objects of foreign types '
                  f'({", ".join(sorted(module.placeholders))}); tensors were loaded',
                  logger='current')
    return obj


def patch_mmengine_loading() -> bool:
    """Make mmengine read local checkpoints through :func:`load_checkpoint_file`.

    mmengine 0.10 calls ``torch.load`` with torch's default, which since torch
    2.6 is ``weights_only=True``, and its own checkpoints (numpy values and
    history buffers in the message hub) then fail to load: ``--resume``,
    ``load_from`` and ``tools/test.py CKPT`` break. The restricted loader reads
    them and still refuses pickles that name code. Returns False without mmengine.
    """
    try:
        from mmengine.runner.checkpoint import CheckpointLoader
    except ImportError:
        return False

    def load_from_local(filename, map_location):
        return load_checkpoint_file(os.path.expanduser(filename), map_location)
    CheckpointLoader.register_scheme(prefixes='', loader=load_from_local, force=True)
    return True


def _strip(key: str, prefix: str) -> str:
    return key[len(prefix):] if key.startswith(prefix) else key


def nested_keys(checkpoint) -> list:
    """The ``STATE_DICT_KEYS`` under which ``checkpoint`` nests state dicts, in
    order of preference."""
    if not isinstance(checkpoint, dict):
        return []
    return [key for key in STATE_DICT_KEYS if isinstance(checkpoint.get(key), dict)]


def unwrap_state_dict(checkpoint):
    """The state dict a loaded checkpoint nests under the first of its
    :func:`nested_keys` (``'model'`` for the release, ``'state_dict'`` for
    mmengine), or the checkpoint itself."""
    keys = nested_keys(checkpoint)
    return checkpoint[keys[0]] if keys else checkpoint


def _describe(checkpoint) -> str:
    if isinstance(checkpoint, dict):
        keys = list(checkpoint)
        return f"its keys: {keys[:8]}{' ...' if len(keys) > 8 else ''}" if keys else 'it is empty'
    return f'it is a {type(checkpoint).__name__}'


def extract_state_dict(checkpoint, prefix: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The tensors of a model from a loaded checkpoint: ``checkpoint['model']``
    (the FLatten release), ``['state_dict']`` (mmengine), an EMA-only entry
    (``STATE_DICT_KEYS``) or the dict itself, with DDP's ``module.`` removed.
    With ``prefix`` (mmengine's ``Pretrained`` option, e.g. ``'backbone'``; its
    dot added as mmengine adds it) only the keys under it, stripped of it, with
    or without ``module.`` before it; without, of a whole detector or segmenter
    (keys ``backbone.*``, ``neck.*``, ...) only the backbone. Weights held as
    another library's arrays raise an error naming them; other entries that
    are not tensors (an epoch, a score) are left out."""
    sd = unwrap_state_dict(checkpoint)
    if not isinstance(sd, dict):
        raise ValueError(f'checkpoint holds no state dict ({_describe(checkpoint)})')
    entries = _select(sd, prefix)
    arrays = [f'{k!r} ({type(v).__module__}.{type(v).__name__})' for k, v in entries.items()
              if getattr(v, 'ndim', 0) and not isinstance(v, torch.Tensor)]
    if arrays:  # never skipped silently (then reported as missing)
        raise ValueError(f'checkpoint entries are arrays but not torch tensors: '
                         f'{", ".join(arrays[:4])}{" ..." if len(arrays) > 4 else ""}; '
                         'convert them (torch.from_numpy) and save again')
    tensors = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f'checkpoint holds no tensors ({_describe(checkpoint)})')
    return tensors


def _select(sd: dict, prefix: Optional[str]) -> dict:
    """The entries of state dict ``sd`` that :func:`extract_state_dict` takes,
    renamed (prefix, DDP's ``module.``, a whole model's ``backbone.`` removed)."""
    unwrapped = {_strip(k, 'module.'): v for k, v in sd.items()}  # DDP's wrapper
    if prefix:
        prefix = prefix if prefix.endswith('.') else prefix + '.'
        for keys in (sd, unwrapped):
            picked = {k[len(prefix):]: v for k, v in keys.items() if k.startswith(prefix)}
            if any(isinstance(v, torch.Tensor) for v in picked.values()):
                return picked
        raise ValueError(f'checkpoint holds no tensors under the prefix {prefix!r} '
                         f'(first keys: {list(sd)[:4]})')
    if any(k.startswith('backbone.') and isinstance(v, torch.Tensor)
           for k, v in unwrapped.items()):  # of a whole detector or segmenter
        return {k[len('backbone.'):]: v for k, v in unwrapped.items() if k.startswith('backbone.')}
    return unwrapped


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(re.match(p, key) for p in patterns)


def read_state_dict(path: str, prefix: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """:func:`extract_state_dict` of the checkpoint file ``path``; errors name the
    file, and the log says which entry of the file was taken if it has several
    (e.g. the release's ``'model'`` beside its ``'state_dict_ema'``)."""
    checkpoint = load_checkpoint_file(path)
    try:
        sd = extract_state_dict(checkpoint, prefix)
    except ValueError as err:
        raise ValueError(f'{path}: {err}') from None
    held = nested_keys(checkpoint)
    if len(held) > 1:
        print_log(f'{path} holds the weights {held}: loading {held[0]!r}', logger='current')
    return sd


def local_checkpoint(path: str) -> str:
    """``path``, or for an http(s) URL (as mmengine's ``Pretrained`` takes) its
    copy in torch's hub cache (``$TORCH_HOME/hub/checkpoints``, where mmengine
    keeps downloads too), downloaded if absent, by rank 0 first when
    distributed. The file is then read by the safe loader like any other."""
    scheme = urllib.parse.urlparse(path).scheme
    if scheme not in ('http', 'https'):
        if '://' in path:
            raise ValueError(f"checkpoint {path!r}: FLatten backbones load local files and "
                             f"http(s) URLs, not {scheme}:// (download it, and give its path)")
        return path
    # the URL's file name (if any) and a hash of the whole URL: two URLs never
    # share a cached file (versions in the path, ids in the query)
    name = os.path.basename(urllib.parse.urlparse(path).path) or 'checkpoint.pth'
    local = os.path.join(torch.hub.get_dir(), 'checkpoints',
                         f'{hashlib.sha256(path.encode()).hexdigest()[:8]}-{name}')
    from mmengine.dist import barrier, get_dist_info
    rank, world_size = get_dist_info()
    try:
        if rank == 0:
            _download(path, local)
    finally:  # the other ranks never wait for a download that failed
        if world_size > 1:
            barrier()
    _download(path, local)  # a rank of another node, or rank 0 failed: on its own
    return local


def _download(url: str, local: str) -> None:
    if not os.path.isfile(local):
        os.makedirs(os.path.dirname(local), exist_ok=True)
        print_log(f'downloading {url} to {local}', logger='current')
        torch.hub.download_url_to_file(url, local)  # to a temporary file, then moved


def load_pretrained(model: nn.Module,
                    path: str,
                    ignore_unexpected: Iterable[str] = (),
                    ignore_missing: Iterable[str] = (),
                    prefix: Optional[str] = None) -> None:
    """Load an (official or our own) checkpoint into ``model``; ``prefix``: only
    the checkpoint's keys under it (:func:`extract_state_dict`).

    Expected differences (regular expressions in ``ignore_unexpected`` /
    ``ignore_missing``, e.g. a classifier head, or layers only dense models
    have) are logged. Anything else that does not fit (a tensor of another
    shape, a weight the model lacks or needs) raises ValueError naming it,
    since it means the checkpoint is of another architecture.
    """
    local = local_checkpoint(path)
    try:
        sd = read_state_dict(local, prefix)  # the model's load hook converts it
    except ValueError as err:
        if local == path:
            raise
        raise ValueError(f'{err} (downloaded from {path}: delete the file to download '
                         'it again)') from None
    try:
        result = model.load_state_dict(sd, strict=False)
    except RuntimeError as err:
        raise ValueError(f'{path} does not fit {type(model).__name__}: {err}') from None
    missing = [k for k in result.missing_keys if not _matches(k, ignore_missing)]
    unexpected = [k for k in result.unexpected_keys if not _matches(k, ignore_unexpected)]
    if missing or unexpected:
        def show(keys):
            return ', '.join(keys[:8]) + (f' and {len(keys) - 8} more' if len(keys) > 8 else '')
        parts = []
        if missing:
            parts.append(f'{len(missing)} weights of the model are not in the '
                         f'checkpoint ({show(missing)})')
        if unexpected:
            parts.append(f'{len(unexpected)} weights of the checkpoint have no '
                         f'place in the model ({show(unexpected)})')
        raise ValueError(f'{path} does not fit {type(model).__name__}: '
                         + '; '.join(parts)
                         + '. Is it a checkpoint of another architecture?')
    print_log(f'loaded {path} into {type(model).__name__}; not in the checkpoint '
              f'(newly initialised): {result.missing_keys or "none"}; unused from '
              f'the checkpoint: {result.unexpected_keys or "none"}', logger='current')
