"""The documentation stays true to the code: every `fxpar ...` command in a shell block of README.md
and docs/*.md parses with the CLI's own parser, every import in a Python block (and in a shell
block's `python -c`) resolves, and every relative link points to a file (and heading) that exists.
examples/check_docs.py, whose extraction this test shares, runs the commands."""
import contextlib
import importlib
import importlib.util
import io
import pathlib
import re
import shlex
import sys
from unittest import mock

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_docs", ROOT / "examples" / "check_docs.py")
check_docs = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_docs", check_docs)  # dataclasses look their module up there
_spec.loader.exec_module(check_docs)

FILES = check_docs.doc_files(ROOT)
COMMANDS = check_docs.all_commands(FILES)
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", ">&", "&>", ">|"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")


def _segments(text: str) -> list[list[str]]:
    """The simple commands of a shell line, without redirections and variable assignments."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    segments, current, skip = [], [], False
    for token in lexer:
        if skip:
            skip = False
        elif token in SEPARATORS:
            segments.append(current)
            current = []
        elif token in REDIRECTS:
            if current and current[-1].isdigit():
                current.pop()  # 2> FILE
            skip = True
        elif not current and _ASSIGNMENT.match(token):
            continue  # NAME=value before the command
        else:
            current.append(token)
    segments.append(current)
    return [s for s in segments if s]


def _fxpar_argvs():
    for command in COMMANDS:
        for argv in _segments(command.text):
            if argv[0] == "fxpar":
                yield command, argv[1:]


class _Parsed(Exception):
    """Raised in place of running calibration, once its arguments parsed."""


def _parse(argv: list[str]) -> None:
    """Parse as `fxpar` would; SystemExit (argparse's error) propagates."""
    if argv[:1] == ["calibrate"]:  # its own parser, in cost_model.calibration.calibrate.main
        from cost_model.calibration import calibrate

        def parsed(*args, **kwargs):
            raise _Parsed

        with mock.patch.object(calibrate, "calibrate", parsed):
            try:
                calibrate.main(argv[1:])
            except _Parsed:
                return
        raise AssertionError("calibrate.main returned without calibrating")
    from planner.cli import build_parser
    build_parser().parse_args(argv)


def test_the_docs_have_commands():
    assert len(FILES) >= 8, FILES
    assert sum(1 for _ in _fxpar_argvs()) >= 30
    assert {argv[0] for _, argv in _fxpar_argvs()} >= {"plan", "simulate", "run", "bench",
                                                       "calibrate", "export"}


@pytest.mark.parametrize("command, argv", list(_fxpar_argvs()),
                         ids=[c.where() for c, _ in _fxpar_argvs()])
def test_fxpar_commands_parse(command, argv):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            _parse(argv)
    except SystemExit as exit_:
        pytest.fail(f"{command.where()}: `{command.text}` does not parse (exit {exit_.code}): "
                    f"{stderr.getvalue().strip()}")


_FROM = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+\(?([\w\s,]+?)\)?\s*(#.*)?$")
_IMPORT = re.compile(r"^\s*import\s+([\w.]+(?:\s*,\s*[\w.]+)*)\s*(#.*)?$")


def _imports():
    """(where, module, name or None) for every import line of the Python blocks, and for the
    `from X import Y` statements of `python -c` commands."""
    for path in FILES:
        for block in check_docs.blocks(path):
            if block.lang in ("python", "py"):
                for offset, line in enumerate(block.lines, 1):
                    where = f"{path.relative_to(ROOT)}:{block.line + offset}"
                    if m := _FROM.match(line):
                        for name in m.group(2).split(","):
                            if name.strip():
                                yield where, m.group(1), name.split(" as ")[0].strip()
                    elif m := _IMPORT.match(line):
                        for module in m.group(1).split(","):
                            yield where, module.strip(), None
    for command in COMMANDS:
        for m in re.finditer(r"\bfrom\s+([\w.]+)\s+import\s+(\w+)", command.text):
            yield command.where(), m.group(1), m.group(2)
        for m in re.finditer(r"(?:^|[\";]\s*)import\s+([\w.]+)", command.text):
            yield command.where(), m.group(1), None


def test_the_docs_have_imports():
    assert sum(1 for _ in _imports()) >= 8


@pytest.mark.parametrize("where, module, name", list(_imports()),
                         ids=[f"{w}:{m}.{n}" for w, m, n in _imports()])
def test_python_imports_resolve(where, module, name):
    try:
        imported = importlib.import_module(module)
    except ImportError as err:
        pytest.fail(f"{where}: cannot import {module}: {err}")
    if name is not None and not hasattr(imported, name):
        pytest.fail(f"{where}: `from {module} import {name}`: {module} has no {name}")


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(path: pathlib.Path) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, with inline code spans blanked."""
    lines, fence = [], ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = check_docs._FENCE.match(line)
        if fence:
            if match and match.group(2).startswith(fence) and not match.group(3):
                fence = ""
            continue
        if match:
            fence = match.group(2)
            continue
        lines.append((number, re.sub(r"`[^`]*`", "``", line)))
    return lines


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -1, -2, ...
    for repeats."""
    seen: dict[str, int] = {}
    fence = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        match = check_docs._FENCE.match(line)
        if fence:
            if match and match.group(2).startswith(fence) and not match.group(3):
                fence = ""
            continue
        if match:
            fence = match.group(2)
            continue
        if heading := _HEADING.match(line):
            slug = re.sub(r"[^\w\- ]", "", heading.group(2).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def _links():
    for path in FILES:
        for number, line in _prose(path):
            for target in _LINK.findall(line):
                if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    yield f"{path.relative_to(ROOT)}:{number}", path, target


def test_the_docs_have_links():
    assert sum(1 for _ in _links()) >= 15


@pytest.mark.parametrize("where, path, target", list(_links()),
                         ids=[f"{w}:{t}" for w, _, t in _links()])
def test_relative_links_resolve(where, path, target):
    file_part, _, anchor = target.partition("#")
    linked = (path.parent / file_part).resolve() if file_part else path
    if not linked.exists():
        pytest.fail(f"{where}: link to {target}: {linked} does not exist")
    if anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
        pytest.fail(f"{where}: link to {target}: {linked.name} has no heading #{anchor}")
