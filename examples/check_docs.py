"""Run every shell command of README.md and docs/*.md and report which ones fail.

    python examples/check_docs.py                       # every command, file by file, in order
    python examples/check_docs.py --list                # print the commands, run nothing
    python examples/check_docs.py README.md             # README.md's commands only
    python examples/check_docs.py docs/cli.md --match "fxpar plan"   # those matching a regex
    python examples/check_docs.py --slow                # also the commands marked [slow]

The commands are the lines of fenced ```sh, ```bash and ```shell blocks, and the lines that start
with `$ ` in ```console blocks (the other lines there are output); a line ending in a backslash
continues on the next, and blank and comment lines are left out. Other blocks (```text, ```python)
are not run.

Each file's commands run in order, with bash, in a scratch folder of that file's own whose entries
link to the checkout's top-level entries: `examples/...` and `.venv` resolve as they do in the
checkout, a later command finds the files an earlier one wrote (a.json, ckpt/, tiny-llama/), and
nothing is written into the checkout. `make` lines run in the checkout itself, since the Makefile's
set-up installs the checkout. The checkout's `.venv/bin` comes first on PATH, so `fxpar` and
`python` are the project's. A command passes when it exits with status 0 within --timeout
seconds; a failure prints the end of the command's output (all of it is in the log folder the
summary names, with --keep).

Markers: a trailing comment on the command line containing `[gpu]` (needs a CUDA GPU) or
`[multi-node]` (needs torchrun across several machines) skips the command; `[slow]` (takes
longer than ten minutes) skips it unless --slow is given. Commands left out by --match or
marked are listed as skipped in the summary; with --match, a command may fail because an earlier
command it depends on (one that writes its input) did not run.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHELL_LANGS = {"sh", "bash", "shell", "console"}
MARKERS = ("gpu", "multi-node", "slow")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass
class Block:
    path: pathlib.Path
    line: int          # 1-based line of the opening fence
    lang: str
    lines: list[str]


@dataclass
class Command:
    path: pathlib.Path
    line: int          # 1-based line where the command starts
    text: str          # the command, continuation lines joined, trailing comment removed
    comment: str = ""
    markers: set[str] = field(default_factory=set)

    def where(self) -> str:
        try:
            name = self.path.relative_to(ROOT)
        except ValueError:
            name = self.path
        return f"{name}:{self.line}"


def doc_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """README.md and docs/*.md, in that order."""
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def blocks(path: pathlib.Path) -> list[Block]:
    """Every fenced code block of a Markdown file."""
    found, current, fence = [], None, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = _FENCE.match(line)
        if current is None:
            if match:
                fence = match.group(2)
                current = Block(path, number, match.group(3).lower(), [])
        elif match and match.group(2).startswith(fence) and not match.group(3):
            found.append(current)
            current = None
        else:
            current.lines.append(line)
    return found


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: the comment starts at the first unquoted `#` that begins
    a word."""
    quote, escaped = "", False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def commands(block: Block) -> list[Command]:
    """The commands of a shell block (for console blocks, only the `$ ` lines)."""
    if block.lang not in SHELL_LANGS:
        return []
    found: list[Command] = []
    pending: Command | None = None
    for offset, raw in enumerate(block.lines, 1):
        number = block.line + offset
        if pending is None:
            line = raw.strip()
            if block.lang == "console":
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:].strip()
            if not line or line.startswith("#"):
                continue
            pending = Command(block.path, number, "")
        else:
            line = raw.strip()
        code, comment = split_comment(line)
        continued = code.endswith("\\") and not comment
        pending.text += (" " if pending.text else "") + (code[:-1].rstrip() if continued else code)
        if comment:
            pending.comment = comment
            pending.markers = {m for m in MARKERS if f"[{m}]" in comment}
        if not continued:
            found.append(pending)
            pending = None
    if pending is not None:
        found.append(pending)
    return found


def all_commands(files: list[pathlib.Path]) -> list[Command]:
    return [c for path in files for b in blocks(path) for c in commands(b)]


def _scratch(folder: pathlib.Path) -> None:
    """A folder whose entries link to the checkout's top level (but .git)."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name != ".git" and not (folder / entry.name).exists():
            (folder / entry.name).symlink_to(entry)


def _run(command: Command, cwd: pathlib.Path, log: pathlib.Path, timeout: float) -> tuple[bool, str]:
    env = dict(os.environ)
    venv_bin = ROOT / ".venv" / "bin"
    if venv_bin.is_dir():
        env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(ROOT / ".venv")
    env.setdefault("MPLBACKEND", "Agg")
    with open(log, "w", encoding="utf-8") as out:
        out.write(f"$ {command.text}\n")
        out.flush()
        proc = subprocess.Popen(["bash", "-c", command.text], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            status = proc.wait(timeout=timeout)
            reason = "" if status == 0 else f"exit status {status}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reason = f"timed out after {timeout:g} s"
    return not reason, reason


def _tail(log: pathlib.Path, lines: int = 20) -> str:
    text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join("    | " + line for line in text[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=pathlib.Path,
                        help="Markdown files (default: README.md and docs/*.md)")
    parser.add_argument("--list", action="store_true", help="print the commands and run nothing")
    parser.add_argument("--match", metavar="REGEX", help="run only the commands matching REGEX")
    parser.add_argument("--skip", metavar="REGEX", help="leave out the commands matching REGEX")
    parser.add_argument("--slow", action="store_true", help="also run the commands marked [slow]")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    parser.add_argument("--workdir", type=pathlib.Path,
                        help="where the scratch folders go (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch folders and logs (always kept with --workdir)")
    args = parser.parse_args(argv)

    files = [p.resolve() for p in args.files] or doc_files()
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    found = all_commands(files)
    if args.list:
        for c in found:
            marks = "".join(f" [{m}]" for m in sorted(c.markers))
            print(f"{c.where():<22} {c.text}{marks}")
        print(f"{len(found)} commands in {len(files)} files")
        return 0

    work = args.workdir.resolve() if args.workdir else pathlib.Path(tempfile.mkdtemp(prefix="check_docs-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[tuple[Command, str, float, str]] = []  # (command, PASS/FAIL/SKIP, seconds, why)
    for index, c in enumerate(found, 1):
        why = ""
        if args.match and not re.search(args.match, c.text):
            why = "not matched"
        elif args.skip and re.search(args.skip, c.text):
            why = "--skip"
        elif "gpu" in c.markers:
            why = "[gpu]"
        elif "multi-node" in c.markers:
            why = "[multi-node]"
        elif "slow" in c.markers and not args.slow:
            why = "[slow]"
        if why:
            results.append((c, "SKIP", 0.0, why))
            if why != "not matched":
                print(f"SKIP           {c.where():<22} {c.text}  ({why})", flush=True)
            continue
        page = work / c.path.stem
        _scratch(page)
        cwd = ROOT if re.match(r"(\w+=\S*\s+)*make(\s|$)", c.text) else page
        log = work / f"{index:03d}-{c.path.stem}-{c.line}.log"
        start = time.perf_counter()
        ok, reason = _run(c, cwd, log, args.timeout)
        seconds = time.perf_counter() - start
        results.append((c, "PASS" if ok else "FAIL", seconds, reason))
        print(f"{'PASS' if ok else 'FAIL'} {seconds:7.1f} s  {c.where():<22} {c.text}", flush=True)
        if not ok:
            print(f"    {reason}; the end of its output:\n{_tail(log)}", flush=True)

    passed = sum(1 for r in results if r[1] == "PASS")
    failed = [r for r in results if r[1] == "FAIL"]
    skipped = [r for r in results if r[1] == "SKIP"]
    reasons: dict[str, int] = {}
    for r in skipped:
        reasons[r[3]] = reasons.get(r[3], 0) + 1
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
    print(f"\n{len(results)} commands: {passed} passed, {len(failed)} failed, {len(skipped)} "
          f"skipped{f' ({why})' if why else ''}; {sum(r[2] for r in results):.0f} s")
    for c, _, _, reason in failed:
        print(f"  failed: {c.where()}  {c.text}  ({reason})")
    if args.keep or args.workdir:
        print(f"scratch folders and logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
