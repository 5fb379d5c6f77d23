"""Typed configuration: dataclasses + a YAML file (`--config`) + command-line overrides.

Built on `transformers.HfArgumentParser`. YAML values go through the same argparse type
conversion as command-line flags, so a value is checked the same way wherever it comes from.
Everything is validated before any process group, file or MLflow run exists; a bad value ends
the program with one line naming the field, the value and what is accepted.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, get_type_hints

import yaml
from transformers import HfArgumentParser

from infra.errors import USAGE_EXIT_CODE, RunError


class ConfigError(RunError, ValueError):
    """A configuration problem, phrased for the user in one sentence."""

    kind = "config"


def require(ok: bool, name: str, value: Any, accepted: str) -> None:
    """Raise a one-sentence ConfigError unless `ok`."""
    if not ok:
        raise ConfigError(f"{name}={value!r} is not valid: expected {accepted}")


class _Prose(argparse.ArgumentDefaultsHelpFormatter):
    """A help text is prose: its `%` ("over 5% of its time") is a percent sign, not one of argparse's format codes
    (which made `--help` raise), but for argparse's own `%(default)s` and the like."""

    def _get_help_string(self, action: argparse.Action) -> str:
        prose = copy.copy(action)
        prose.help = re.sub(r"%(?!\()", "%%", action.help or "")
        return super()._get_help_string(prose)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        """`--learning_rate VALUE`: the flag once (not its dashed alias), its values in a word."""
        if not action.option_strings or action.nargs == 0:
            return ", ".join(action.option_strings)
        if action.metavar:
            value = action.metavar
        elif action.choices:
            value = "{" + ",".join(map(str, action.choices)) + "}"
        elif action.nargs == "?":
            value = "[true|false]"
        else:
            value = "VALUE ..." if action.nargs in ("+", "*") else "VALUE"
        return f"{action.option_strings[0]} {value}"


class _Parser(HfArgumentParser):
    """HfArgumentParser whose errors are exceptions rather than a usage dump and exit, and whose `--help` lists the
    flags by the section that declares them (a dataclass's `_argument_group_name`, else its name: ModelArguments ->
    "model"), `--config` first."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Prose)
        kwargs.setdefault("usage", "%(prog)s [--config FILE.yaml] [--FIELD VALUE ...]")
        kwargs.setdefault(
            "epilog",
            "A flag overrides the --config file's value. With --config FILE and --help, a flag FILE sets to other than its "
            "default shows both values.",
        )
        super().__init__(*args, **kwargs)
        # argparse takes `-1e-3` for a flag (its pattern of negative numbers has no exponent): `--learning_rate -1e-3`
        # then said "expected one argument" instead of naming the value
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def _add_dataclass_arguments(self, dtype) -> None:
        hints = get_type_hints(dtype)
        groups: dict[str, Any] = {}
        for field in dataclasses.fields(dtype):
            if not field.init:
                continue
            field.type = hints[field.name]
            title = section_title(next(c for c in dtype.__mro__ if field.name in c.__dict__.get("__annotations__", {})))
            if title not in groups:
                groups[title] = self.add_argument_group(title)
            self._parse_dataclass_field(groups[title], field)

    def show_config(self, path: str, values: dict) -> None:
        """`--config FILE --help`: FILE's value beside each flag it sets to other than the default."""
        for action in self._actions:
            if action.dest in values and values[action.dest] != action.default and action.help is not None:
                action.help += f" [{path}: {values[action.dest]!r}]"

    def error(self, message):
        message = re.sub(r"argument --(\w+)/--[\w-]+", r"argument --\1", message)
        bad_type = re.fullmatch(r"argument --(\w+): invalid (\w+) value: (.*)", message)
        if bad_type:
            name, kind, value = bad_type.groups()
            message = f"{name}={value} is not valid: expected {_KINDS.get(kind, kind)}"
        raise ConfigError(message)


_KINDS = {"int": "an integer", "float": "a number", "string_to_bool": "true or false"}


def section_title(section: type) -> str:
    """A section's heading in --help: its `_argument_group_name` (transformers' convention), else its name in words."""
    if "_argument_group_name" in section.__dict__:
        return section._argument_group_name
    name = re.sub(r"(Arguments|Config)$", "", section.__name__) or section.__name__
    return name if name.isupper() else re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower()


def parse_config(dataclass_types: tuple[type, ...], argv: list[str] | None = None, check=None) -> tuple:
    """Parse `--config file.yaml` plus command-line overrides into the given dataclasses.

    `check(*parsed)` may raise ConfigError for what involves fields of several dataclasses. On any
    problem prints one line to stderr and exits with status 2, having created nothing.
    """
    try:
        parsed = _parse(dataclass_types, sys.argv[1:] if argv is None else list(argv))
        if check is not None:
            check(*parsed)
        return parsed
    except ConfigError as err:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            # A machine's processes read the same flags and files: its local rank 0 says it, and the launcher stops the
            # others once it exits. A process still here after a while (rank 0 slower to get this far) says it too.
            time.sleep(SAID_BY_LOCAL_RANK_0_SECONDS)
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(USAGE_EXIT_CODE) from None


SAID_BY_LOCAL_RANK_0_SECONDS = 30.0  # it is stopped as soon as local rank 0 exits: waiting longer delays nothing


def _parse(dataclass_types: tuple[type, ...], argv: list[str]) -> tuple:
    parser = _Parser(dataclass_types, allow_abbrev=False)  # a typo must not silently match a longer flag
    parser.add_argument("--config", type=str, default=None, metavar="FILE.yaml", help="Field: value pairs; flags override them.")
    if {"-h", "--help"} & set(argv):
        path = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])[0].config
        if path is not None:
            parser.show_config(path, _read_yaml(path))
    known, _ = parser.parse_known_args(argv)  # --help prints and exits here

    fields = {f.name: f for dtype in dataclass_types for f in dataclasses.fields(dtype) if f.init}
    yaml_argv, nulls = [], []
    if known.config is not None:
        values = _read_yaml(known.config)
        for key, value in values.items():
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(f"{known.config}: unknown key '{key}'{hint}")
            if value is None:
                nulls.append(key)
            else:
                yaml_argv += _as_flags(key, value)
        try:  # the YAML alone first, so that an error names the file it came from
            parser.parse_args_into_dataclasses(args=yaml_argv, look_for_args_file=False)
        except ConfigError as err:
            raise ConfigError(f"{known.config}: {err}") from None

    cli = _without_flag(argv, "--config")
    *outputs, unknown = parser.parse_args_into_dataclasses(args=yaml_argv + cli, look_for_args_file=False, return_remaining_strings=True)
    if unknown:
        flag = next((a for a in unknown if a.startswith("--")), unknown[0])
        close = difflib.get_close_matches(flag.lstrip("-").split("=")[0], fields, n=1)
        hint = f" (did you mean '--{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown argument {' '.join(unknown)!r}{hint}")
    outputs = [o for o in outputs if dataclasses.is_dataclass(o)]
    cli_keys = {a[2:].split("=")[0].replace("-", "_") for a in cli if a.startswith("--")}
    for obj in outputs:  # `key: null` in the YAML, unless a flag set the key again
        names = {f.name for f in dataclasses.fields(obj)}
        for key in set(nulls) & names - cli_keys:
            setattr(obj, key, None)
        if set(nulls) & names and hasattr(obj, "__post_init__"):
            obj.__post_init__()
    return tuple(outputs)


def _read_yaml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        values = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value, got {type(values).__name__}")
    return values


def _as_flags(key: str, value: Any) -> list[str]:
    if isinstance(value, list):  # a mapping in the list becomes one `k=v,k=v` item (data_mixture's sources)
        return [f"--{key}", *(",".join(f"{k}={v}" for k, v in item.items()) if isinstance(item, dict) else str(item) for item in value)]
    if isinstance(value, (dict, tuple, set)):
        raise ConfigError(f"{key}={value!r} is not valid: expected a single value")
    return [f"--{key}", str(value)]


def _without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def resolved(*configs) -> dict[str, dict[str, Any]]:
    """The resolved configuration, one section per dataclass (as saved next to checkpoints)."""
    return {type(c).__name__: dataclasses.asdict(c) for c in configs}


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`: the dotted names MLflow shows as params."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def to_json(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True, default=str)
