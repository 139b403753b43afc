"""The tools under tools/analysis_tools, loaded as modules for their tests."""
import importlib.util
import os.path as osp
import sys
from types import ModuleType

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TOOLS = osp.join(ROOT, 'tools', 'analysis_tools')


def load_tool(name: str) -> ModuleType:
    """tools/analysis_tools/NAME.py as a fresh module (the tools import each
    other by name: their folder goes on the path)."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    spec = importlib.util.spec_from_file_location(name, osp.join(TOOLS, f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
