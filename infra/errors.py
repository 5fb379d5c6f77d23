"""The one error policy: library code raises a typed `RunError`; the edge (a recipe's entry point, infra.recipe.run_recipe)
turns it into one line on stderr, `<kind> error: <what>`, and exit code 1, with nothing half-written behind it.

    ConfigError      config       a flag or YAML key, or flags that do not go together (infra.config)
    LaunchError      launch       the processes do not form the job asked for, or the engine cannot run it
    DataError        data         the prepared data is missing, damaged, or does not fit the model or the run
    ModelError       model        a model that cannot be loaded or adapted
    CheckpointError  checkpoint   a checkpoint that cannot be written, or one asked for that cannot be used
    OutputDirError   output_dir   another live job holds the output_dir
    HealthError      health       non-finite steps the run was told to stop at, or that rollbacks did not cure
    PreflightError   preflight    a preflight check failed (its line names the check)

A bug is not a RunError: it propagates with its traceback. Command-line tools (`python -m infra.<tool>`) are edges of
their own and exit with their own codes.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import re
from collections.abc import Iterator
from typing import NoReturn

USAGE_EXIT_CODE = 2  # a mistake in the configuration, said in one line by the program (argparse's code for a usage error)


class RunError(Exception):
    """A stop its user can act on, phrased as one sentence."""

    kind = "run"

    def line(self) -> str:
        return f"{self.kind} error: {self}"


class ModelError(RunError, ValueError):
    """A model that cannot be loaded, or adapted as asked (LoRA target modules it lacks)."""

    kind = "model"


class HealthError(RunError):
    """Non-finite steps the run stops at (on_bad_steps=stop, max_rollbacks spent, nothing to roll back to)."""

    kind = "health"


class OutputDirError(RunError):
    """Another live job holds the output_dir."""

    kind = "output_dir"


@contextlib.contextmanager
def raised_as(kind: type[RunError], *errors: type[Exception]) -> Iterator[None]:
    """Another library's `errors` (OSError from a from_pretrained, say) raised again as `kind`, with their message."""
    try:
        yield
    except errors as err:
        raise kind(str(err)) from None


class ToolParser(argparse.ArgumentParser):
    """argparse for a command-line tool (`python -m infra.<tool>`): a mistake is one line, `<tool>: <what>`, with the
    flag it was closest to, and exit code 2 (argparse prints its whole usage first)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # a typo must not silently match a longer flag
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (--[\w-]+)", message)
        if unknown and (close := difflib.get_close_matches(unknown[1], sorted(self.flags()), n=1)):
            message += f" (did you mean '{close[0]}'?)"
        self.exit(USAGE_EXIT_CODE, f"{self.prog}: {message}; --help lists the arguments\n")

    def flags(self) -> set[str]:
        """Every `--flag` of this parser and of its subcommands."""
        found = set()
        for action in self._actions:
            found |= {s for s in action.option_strings if s.startswith("--")}
            if isinstance(action, argparse._SubParsersAction):
                found |= {flag for sub in action.choices.values() for flag in sub.flags()}
        return found
