"""Command-line options declared once, on the fields of the config dataclasses.

A field is an option when its `metadata` has "help". Its default and type are the field's
own, so the parser can never drift from the library; the metadata adds only what a parser
needs beyond them:

- `help`: what it does (required); `group`: where `--help` lists it (see `GROUPS`);
- `flag`: the option's name when it is not the field's (`--threads` for `n_threads`);
- `kind`: how a value is read: "bytes" (64M, 2G), "address" / "bind" (a ZeroMQ endpoint to
  reach / to bind), "addresses" (endpoints to reach, separated by commas; the option may be
  repeated, each time adding to the list), "layers" (A:B), "split" (6,12), "names" (a,b: a
  tuple of strings);
- `min` / `max`: bounds, checked when parsed and reported with the flag's name;
- `choices`: the values allowed, or a mapping from what is typed to the field's value;
- `shown`: the default as `--help` words it, where the value itself says little (None);
- `zero_is_none`: 0 means None (off) on the command line;
- `repeat`: a "names" option that may be repeated, each time adding to the tuple;
- `nested`: for a dataclass-valued field whose class carries no metadata of its own
  (`engine.budgets.Limits`, `protocol.sampling.Sampling`): the metadata of its fields.

A field with no help whose type is a dataclass (NodeConfig.engine) is walked into. Every
option is parsed with no default, so a command knows what was typed: the values typed win
over a `--config` file's, and those over the field's own default (`build`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from transport.address import AddressError, check_address

# Where `--help` lists an option, in this order: what a first-time operator needs first.
GROUPS = {
    "start": "essentials",
    "options": "general",
    "limits": "limits",
    "tuning": "tuning",
    "memory": "memory bounds (see README, 'Memory bounds')",
    "curve": "CurveZMQ (authenticated, encrypted links)",
}
_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


class OptionError(ValueError):
    """A value that an option cannot take; the message names the option."""


@dataclass(frozen=True, slots=True)
class Option:
    path: tuple[str, ...]  # field names from the root dataclass, e.g. ("engine", "max_sessions")
    name: str  # the flag without its dashes; also the option's key in a --config file
    kind: type  # int, float, str, bool or Path (None stripped from the field's type)
    default: Any  # MISSING when the option is required
    meta: Mapping[str, Any]

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def is_switch(self) -> bool:
        """A flag that takes no value (--batch-invariant, --no-batch-invariant)."""
        return self.kind is bool and "choices" not in self.meta

    @property
    def metavar(self) -> str:
        if "metavar" in self.meta:
            return str(self.meta["metavar"])
        if "choices" in self.meta:
            return "{" + ",".join(self.meta["choices"]) + "}"
        if self.meta.get("kind") == "bytes":
            return "SIZE"
        return {int: "N", float: "NUM", Path: "FILE"}.get(self.kind, self.name.upper())

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    def parse(self, text: str) -> Any:
        """The field's value for what was typed; OptionError saying what is expected."""
        value = _read(self, text)
        low, high = self.meta.get("min"), self.meta.get("max")
        if value is not None and low is not None and value < low:
            raise OptionError(f"must be at least {_show(self, low)}, got {text}")
        if value is not None and high is not None and value > high:
            raise OptionError(f"must be at most {_show(self, high)}, got {text}")
        if self.meta.get("zero_is_none") and value == 0:
            return None
        return value

    def shown_default(self) -> str:
        if "shown" in self.meta:
            return str(self.meta["shown"])
        choices = self.meta.get("choices")
        if isinstance(choices, Mapping):
            return str(next(k for k, v in choices.items() if v == self.default))
        if self.is_switch:
            return "on" if self.default else "off"
        return "none" if self.default is None else _show(self, self.default)


def options_of(cls: type, prefix: tuple[str, ...] = (), nested: Mapping[str, Any] | None = None) -> list[Option]:
    """The options of a config dataclass, its walked-into fields included, in field order."""
    hints = typing.get_type_hints(cls)
    found: list[Option] = []
    for f in dataclasses.fields(cls):
        meta = nested.get(f.name) if nested is not None else f.metadata
        hint = hints[f.name]
        if meta is None:
            continue
        if "help" in meta:
            found.append(_option((*prefix, f.name), f, _base(hint), meta))
        elif "nested" in meta:
            found += options_of(hint, (*prefix, f.name), meta["nested"])
        elif dataclasses.is_dataclass(hint) and isinstance(hint, type):
            found += options_of(hint, (*prefix, f.name))
    return found


def _option(path: tuple[str, ...], f: dataclasses.Field[Any], kind: type, meta: Mapping[str, Any]) -> Option:
    if f.default is not MISSING:
        default = f.default
    elif f.default_factory is not MISSING:
        default = f.default_factory()
    else:
        default = MISSING
    name = meta.get("flag", f.name.replace("_", "-"))
    return Option(path, name, kind, default, meta)


def _base(hint: Any) -> type:
    """int, float, str, bool or Path: the type of a field's value, None stripped."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    return hint if isinstance(hint, type) else str


def _read(option: Option, text: str) -> Any:
    kind, choices = option.meta.get("kind"), option.meta.get("choices")
    if choices is not None:
        if text not in choices:
            raise OptionError(f"must be one of {', '.join(choices)}, got {text!r}")
        return choices[text] if isinstance(choices, Mapping) else text
    try:
        if kind in ("address", "bind"):
            return check_address(text, bind=kind == "bind")
        if kind == "addresses":
            return ",".join(check_address(a.strip()) for a in text.split(",") if a.strip())
        if kind == "bytes":
            unit = _UNITS.get(text[-1:].lower(), 1)
            return int(float(text[:-1]) * unit) if unit > 1 else int(text)
        if kind == "layers":
            a, b = (int(x) for x in text.split(":"))
            return a, b
        if kind == "split":
            return [int(x) for x in text.split(",") if x]
        if kind == "names":
            return tuple(x.strip() for x in text.split(",") if x.strip())
        return option.kind(text)
    except AddressError as exc:
        raise OptionError(str(exc)) from None
    except ValueError:
        raise OptionError(f"expected {_EXPECTED.get(kind or option.kind.__name__, 'a value')}, got {text!r}") from None


_EXPECTED = {
    "bytes": "a size like 512M, 2G or 1048576",
    "layers": "A:B, e.g. 0:6",
    "split": "layer boundaries like 6,12",
    "names": "names separated by commas",
    "int": "a whole number",
    "float": "a number",
}


def _show(option: Option, value: Any) -> str:
    if option.meta.get("kind") == "bytes" and isinstance(value, int):
        for unit, size in reversed(_UNITS.items()):
            if value >= size and value % size == 0:
                return f"{value // size}{unit.upper()}"
    if isinstance(value, tuple):
        return ":".join(map(str, value))
    return str(value)


class _OneLineParser(argparse.ArgumentParser):
    """A mistake on the command line is one line naming the option (not the whole usage), exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def new_parser(**kwargs: Any) -> argparse.ArgumentParser:
    return _OneLineParser(**kwargs)


def add_options(
    parser: argparse.ArgumentParser,
    options: Iterable[Option],
    positional: Sequence[str] = (),
    first: Sequence[str] = (),
    negatable: bool = False,
) -> None:
    """Add each option to its group of `parser`, in `GROUPS` order, those named in `first` first;
    `positional` are also typed bare; `negatable` switches have a --no- form (to undo a --config file's)."""
    options = sorted(options, key=lambda o: first.index(o.name) if o.name in first else len(first))
    parser.usage = " ".join(["%(prog)s", *(f"[{n.upper()}]" for n in positional), "[options]"])
    used = {o.meta.get("group", "options") for o in options}
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items() if key in used}
    for option in options:
        group = groups[option.meta.get("group", "options")]
        text = str(option.meta["help"])
        if option.default is not MISSING:
            text += f" (default: {option.shown_default()})"
        text = text.replace("%", "%%")
        metavar = option.name.upper() if option.name in positional else option.metavar
        convert = _converter(option)
        if option.name in positional:
            group.add_argument(
                option.dest, nargs="?", type=convert, default=argparse.SUPPRESS, metavar=metavar, help=text
            )
            if option.default is MISSING:
                continue
            text = f"the same as {metavar} (default: {option.shown_default()})"
            metavar = option.metavar
        flags = [option.meta["short"], option.flag] if "short" in option.meta else [option.flag]
        if option.is_switch:
            action = argparse.BooleanOptionalAction if negatable else "store_true"
            group.add_argument(*flags, dest=option.dest, action=action, default=argparse.SUPPRESS, help=text)
        else:
            group.add_argument(
                *flags,
                dest=option.dest,
                action=_JoinAction if option.meta.get("kind") == "addresses" or option.meta.get("repeat") else "store",
                type=convert,
                default=argparse.SUPPRESS,
                metavar=metavar,
                help=text,
                required=option.default is MISSING,
            )


class _JoinAction(argparse.Action):
    """A repeated option adds to its list (comma-separated) instead of replacing it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        before = getattr(namespace, self.dest, None)
        if isinstance(before, tuple) and isinstance(values, tuple):
            setattr(namespace, self.dest, before + values)
            return
        setattr(namespace, self.dest, f"{before},{values}" if isinstance(before, str) else values)


def _converter(option: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if text is argparse.SUPPRESS:  # an absent `nargs="?"` positional: argparse converts its default too
            return text
        try:
            return option.parse(text)
        except OptionError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def from_file(options: Iterable[Option], table: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The options set in a --config file (keys are option names, `-` or `_`), parsed like typed values."""
    by_name = {o.name: o for o in options}
    values: dict[str, Any] = {}
    for key, raw in table.items():
        option = by_name.get(key.replace("_", "-"))
        if option is None:
            raise OptionError(f"{source}: unknown option {key!r} (the keys are the long option names of --help)")
        if option.is_switch:
            if not isinstance(raw, bool):
                raise OptionError(f"{source}: {key} must be true or false, got {raw!r}")
            values[option.dest] = raw
            continue
        if isinstance(raw, dict):
            raise OptionError(f"{source}: {key} must be a single value, not a table")
        text = ",".join(map(str, raw)) if isinstance(raw, list) else str(raw)
        try:
            values[option.dest] = option.parse(text)
        except OptionError as exc:
            raise OptionError(f"{source}: {key}: {exc}") from None
    return values


def build(cls: type, options: Iterable[Option], values: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Any:
    """An instance of `cls` from the options' values; a field whose option was not set keeps its default."""
    options = list(options)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        option = next((o for o in options if o.path == path), None)
        if option is not None:
            if option.dest in values:
                kwargs[f.name] = values[option.dest]
            elif option.default is MISSING:
                raise OptionError(f"{option.name.upper()} is required (see --help)")
            continue
        inner = [o for o in options if o.path[: len(path)] == path]
        required = f.default is MISSING and f.default_factory is MISSING
        if inner and (required or any(o.dest in values for o in inner)):
            kwargs[f.name] = build(hints[f.name], inner, values, path)
    return cls(**kwargs)
