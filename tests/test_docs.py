"""The documentation: every config folder has its README naming each of its
configs, metafiles point at those READMEs, and every command in the docs and
READMEs names scripts, configs and options that exist."""
import argparse
import glob
import importlib.util
import os.path as osp
import re
import shlex

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DOCS = sorted(glob.glob(osp.join(ROOT, 'docs', '*.md')) + [osp.join(ROOT, 'README.md')]
              + glob.glob(osp.join(ROOT, 'configs', '*', 'README.md')))


@pytest.mark.parametrize('folder', sorted(glob.glob(osp.join(ROOT, 'configs', '*', ''))))
def test_every_config_folder_has_a_readme_naming_its_configs(folder):
    readme = osp.join(folder, 'README.md')
    assert osp.isfile(readme), f'{readme} is missing'
    text = open(readme).read()
    # a README may name several sizes at once, e.g. flatten-pvtv2-b{3,4,5}_...
    grouped = re.findall(r'`([^`]*\{[^`]*\}[^`]*\.py)`', text)
    for cfg in glob.glob(osp.join(folder, '*.py')):
        name = osp.basename(cfg)
        assert name in text or any(_brace_match(p, name) for p in grouped), \
            f'{name} is not in {readme}'


def _brace_match(pattern: str, name: str) -> bool:
    """`a-{s,m}_b.py` matches a-s_b.py and a-m_b.py."""
    regex = re.sub(r'\\\{([^}]*)\\\}', lambda m: '(' + '|'.join(
        re.escape(x) for x in m.group(1).split(',')) + ')', re.escape(pattern))
    return re.fullmatch(regex, name) is not None


def test_metafiles_point_at_their_readmes():
    for meta in glob.glob(osp.join(ROOT, 'configs', '*', 'metafile.yml')):
        paths = re.findall(r'README: (\S+)', open(meta).read())
        assert paths, meta
        for path in paths:
            assert osp.isfile(osp.join(ROOT, path)), (meta, path)


def commands(path):
    """Shell commands in fenced blocks of a markdown file, continuation lines joined."""
    text = open(path).read()
    for block in re.findall(r'```(?:bash|sh)\n(.*?)```', text, re.S):
        for cmd in re.sub(r'\\\n\s*', ' ', block).splitlines():
            cmd = cmd.split(' #')[0].strip()
            if cmd and not cmd.startswith('#'):
                yield cmd


def script_parser(script: str) -> argparse.ArgumentParser:
    """The argparse parser a tool builds, captured without running it."""
    spec = importlib.util.spec_from_file_location('doc_tool', osp.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    captured = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        captured['parser'] = self
        raise SystemExit(0)
    argparse.ArgumentParser.parse_args = capture
    try:
        module.main([]) if hasattr(module, 'main') else None
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
    return captured.get('parser')


@pytest.mark.parametrize('doc', DOCS, ids=lambda p: osp.relpath(p, ROOT))
def test_commands_in_docs_name_existing_scripts_configs_and_options(doc):
    for cmd in commands(doc):
        words = shlex.split(cmd.replace('{', '').replace('}', '')) if '{' not in cmd else \
            shlex.split(cmd)
        for word in words:
            if word.startswith('configs/') and word.endswith('.py') and '{' not in word:
                assert osp.isfile(osp.join(ROOT, word)), (doc, cmd, word)
        if len(words) > 1 and words[0] == 'python' and words[1].startswith('tools/'):
            script = words[1]
            assert osp.isfile(osp.join(ROOT, script)), (doc, cmd)
            if 'analysis_tools' in script or 'model_converters' in script:
                parser = script_parser(script)
                if parser is not None:
                    known = {s for a in parser._actions for s in a.option_strings}
                    for word in words[2:]:
                        if word.startswith('--'):
                            assert word.split('=')[0] in known, (doc, cmd, word)
        if words[:2] == ['bash', 'tools/dist_train.sh'] or words[0] == 'make':
            assert osp.isfile(osp.join(ROOT, words[1])) or words[0] == 'make', (doc, cmd)


@pytest.mark.parametrize('doc', DOCS, ids=lambda p: osp.relpath(p, ROOT))
def test_relative_links_resolve(doc):
    for target in re.findall(r'\]\(([^)#\s]+)(?:#[^)]*)?\)', open(doc).read()):
        if '://' not in target:
            assert osp.exists(osp.join(osp.dirname(doc), target)), (doc, target)
