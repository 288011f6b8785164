"""How the ``airflow-elastic-gpu`` command line is read: an argument parser that names an unknown
option instead of letting a command's words swallow it, and the argument types the commands share.

Kept apart from the commands (:mod:`airflow_elastic_gpu.cli`), which build their parsers with it.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from typing import Any


def port(text: str) -> int:
    """An argparse type: a TCP port number, 1-65535."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be between 1 and 65535, got {number}")
    return number


def positive_s(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def absolute_path(text: str) -> str:
    """An argparse type: a path made absolute from this shell (``~`` expanded, a relative path taken
    from the current directory): the job's processes have other working directories."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a path, got an empty one")
    return os.path.abspath(os.path.expanduser(text))


class Parser(argparse.ArgumentParser):
    """An argument parser that takes no abbreviation of an option and names an unknown option, with the
    nearest known one, before anything else is checked.

    Plain argparse lets ``run-local``'s command (everything after the options) swallow a misspelled
    option with the rest of the line, then complains that a correctly spelled later option is missing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.global_options: tuple[str, ...] = ()  # a sub-command's: its parent's, named where they go

    def share_options_with_subcommands(self) -> None:
        """Tell each sub-command's parser this parser's options, so that one given after the
        sub-command is named where it goes (call once every sub-command is added)."""
        mine = tuple(o for o in self._option_string_actions if o.startswith("--") and o != "--help")
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    child.global_options = mine

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._reject_unknown_options(args)
        return super().parse_known_args(args, namespace)

    def _reject_unknown_options(self, args: list[str]) -> None:
        """:raises SystemExit: (via :meth:`error`) an option this parser does not know comes before its
        sub-command or its command's words."""
        subcommands = {name for a in self._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}
        takes_rest = any(a.nargs == argparse.REMAINDER for a in self._actions if not a.option_strings)
        skip_value = False
        for word in args:
            if skip_value:
                skip_value = False
                continue
            if word == "--" or word in subcommands:
                return
            if not word.startswith("-") or word == "-" or is_number(word):
                if takes_rest:
                    return
                if subcommands:  # the first word that is no option names the sub-command
                    near = difflib.get_close_matches(word, sorted(subcommands), n=1, cutoff=0.6)
                    hint = f"; did you mean {near[0]}?" if near else f"; choose one of {', '.join(sorted(subcommands))}"
                    self.error(f"unknown command {word!r}{hint}")
                continue
            option, has_value, _ = word.partition("=")
            action = self._option_string_actions.get(option)
            if action is None:
                if option in self.global_options:
                    top, _, command = self.prog.rpartition(" ")
                    self.error(f"{option} goes before the command: {top} {option} ... {command} ...")
                known = [o for o in self._option_string_actions if o.startswith("--")]
                near = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
                hint = f"; did you mean {near[0]}?" if near else f"; see {self.prog} --help"
                self.error(f"unknown option {option}{hint}")
            skip_value = action.nargs != 0 and not has_value


def is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
