"""The `fxpar train` and `fxpar data` subcommands' arguments (planner.cli builds the rest)."""
from __future__ import annotations

import argparse


def train_parsers(sub, epilog: str) -> None:
    """`fxpar train` and `fxpar data` (planner.training.launch, planner.training.prepare)."""
    t = sub.add_parser("train", help="train on token files from a CONFIG.toml (the ranks "
                       "started here by torchrun's engine; restarts re-plan)",
                       epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", metavar="CONFIG.toml")
    t.add_argument("overrides", nargs=argparse.REMAINDER, metavar="--SECTION.KEY VALUE",
                   help="override any key of the config; also --nproc-per-node N, "
                        "--max-restarts R, and --check (check config, data and plan only)")
    t.set_defaults(func=_cmd_train)
    d = sub.add_parser("data", help="tokenize text into the files fxpar train reads")
    dsub = d.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="text files or folders -> train.bin, val.bin, "
                           "header.json (uint16 / uint32 token ids)")
    prep.add_argument("inputs", nargs="+", metavar="TEXT", help="files, or folders searched "
                      "recursively for --include")
    prep.add_argument("--out", required=True, metavar="DIR")
    prep.add_argument("--tokenizer", default="byte", help="byte (built in, vocabulary 256) or "
                      "a Hugging Face tokenizer folder")
    prep.add_argument("--val-fraction", type=float, default=0.01,
                      help="share of the documents held out for validation")
    prep.add_argument("--include", default="*.txt,*.md,*.rst,*.py",
                      help="file name patterns to read in folders (comma-separated)")
    prep.add_argument("--exclude", default="", help="path patterns below the folder to "
                      "leave out (comma-separated, e.g. '*test*')")
    prep.add_argument("--max-bytes", type=int, default=0, help="stop after this much text "
                      "(0: all)")
    info = dsub.add_parser("info", help="what a token folder holds; checks its files")
    info.add_argument("folder", metavar="DIR")
    d.set_defaults(func=_cmd_data)


def _cmd_train(args) -> int:
    from planner.training.config import load
    from planner.training.launch import launch
    overrides = [a for a in args.overrides if a != "--check"]
    return launch(args.config, overrides, load(args.config, overrides),
                  check=len(overrides) != len(args.overrides))


def _cmd_data(args) -> int:
    from planner.training.prepare import cmd_data
    return cmd_data(args)
