"""Command-line options generated from configuration dataclasses: one definition per flag, and
the one place that maps a parameter to its flag.

A dataclass field becomes ``--field-name`` (:data:`FLAGS` renames a few), its help is the field's
entry in the class docstring's ``Attributes:`` section (or a base class's), its type and choices
come from the annotation (``int``, ``float``, ``str``, ``bool``, ``X | None``, ``Literal[...]``;
``metadata={"choices": callable}`` for choices known at run time), and its default is the
field's. A field that is itself a dataclass (a section: ``engine``, ``optim``) adds its own
fields' options.

The library and the trainers name parameters in their errors, never flags: a parameter is
written ``name=value``, or ```name``` without a value. The command line writes each as its flag
(:func:`name_flags`): when a configuration it builds refuses a value (:func:`config_from_args`,
with that class's own fields) and when a run fails with a ``ValueError`` (``posttrain.cli.main``,
with every option of the command).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["FLAGS", "add_config_arguments", "config_from_args", "field_docs", "field_flags", "name_flags"]

_MISSING = dataclasses.MISSING


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its description in the ``Attributes:`` section of the class docstring, or of
    the docstring of the nearest base class that has one for it (one line, as written)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        out.update(_own_field_docs(klass))
    return out


def _own_field_docs(cls: type) -> dict[str, str]:
    doc = cls.__dict__.get("__doc__") or ""
    m = re.search(r"^\s*Attributes:\s*$", doc, re.M)
    if not m:
        return {}
    out: dict[str, str] = {}
    name = None
    indent = None
    for line in doc[m.end():].splitlines():
        if not line.strip():
            continue
        level = len(line) - len(line.lstrip())
        entry = re.match(r"^\s*(\w+):\s*(.*)$", line)
        if entry and (indent is None or level == indent):
            indent = level
            name = entry.group(1)
            out[name] = entry.group(2).strip()
        elif name is not None and indent is not None and level > indent:
            out[name] += " " + line.strip()
        else:
            break
    return {k: " ".join(v.split()) for k, v in out.items()}


def _help(text: str, flags: Mapping[str, str], absent: set[str] = frozenset()) -> str:
    """A field's docstring entry as help: a ``literal`` that names a parameter becomes its flag,
    other ``literals`` lose their quotes, a :role:`target` shows the target. A parameter in
    ``absent`` (one the command does not offer) takes its clause with it: the parenthesis or
    the ``;``-separated part that names it."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    for name in absent:
        lit = re.escape(f"``{name}``")
        text = re.sub(rf"\s*\([^()]*{lit}[^()]*\)", "", text)
        parts = text.split("; ")
        if len(parts) > 1:
            kept = [parts[0], *(p for p in parts[1:] if f"``{name}``" not in p)]
            text = "; ".join(kept) + ("." if text.endswith(".") and not kept[-1].endswith(".") else "")
    return re.sub(r"``([^`]+)``", lambda m: flags.get(m.group(1), m.group(1)), text)


def _resolve(cls: type, name: str) -> Any:
    hints = typing.get_type_hints(cls, include_extras=False)
    return hints[name]


def _parse_type(annotation: Any) -> tuple[Any, tuple | None, bool]:
    """(python type to convert with, choices or None, whether None is allowed); a
    ``tuple[X, ...]`` converts a comma-separated list (:func:`_list_of`)."""
    origin = typing.get_origin(annotation)
    optional = False
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        words = [w for a in args if typing.get_origin(a) is typing.Literal for w in typing.get_args(a)]
        if int in args and len(args) == 2 and words:  # a number, or a word such as auto
            return _int_or(tuple(words)), None, optional
        annotation = args[0] if len(args) == 1 else str
        origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        values = typing.get_args(annotation)
        return type(values[0]), tuple(values), optional
    if origin is tuple:
        item = typing.get_args(annotation)[0]
        return _list_of(item if item in (int, float, str) else str), None, optional
    if annotation in (int, float, str, bool):
        return annotation, None, optional
    return str, None, optional


def _int_or(words: tuple[str, ...]):
    """A converter of a whole number, or one of ``words``, to itself (argparse reports its
    ValueError as an invalid value of the flag)."""

    def convert(text: str) -> int | str:
        return text if text in words else int(text)

    convert.__name__ = f"integer or {' or '.join(words)}"
    return convert


def _list_of(kind: type):
    """A converter of ``"2,4,8"`` to a tuple of ``kind`` (argparse reports its ValueError as
    an invalid value of the flag)."""

    def convert(text: str) -> tuple:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())

    convert.__name__ = f"comma-separated {kind.__name__} list"
    return convert


def _shown(value: Any) -> Any:
    return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else value


#: Flags that are not ``--`` + the parameter's name with dashes, by ``Class.field`` or by field
#: name: the one place the command line renames a parameter of the library or the trainers.
FLAGS = {
    "EngineConfig.name": "--dp",
    "EngineConfig.mode": "--odc-mode",
    "OptimConfig.name": "--optimizer",
    "num_layers": "--layers",
    "num_ranks": "--pp-size",
    "num_microbatches": "--microbatches",
    "num_heads": "--heads",
    # library parameters the command line takes under another name (in the same units)
    "num_chunks": "--chunks",
    "num_gpus": "--world-size",
}


def _flag(cls: type, f: dataclasses.Field) -> str:
    return FLAGS.get(f"{cls.__name__}.{f.name}") or FLAGS.get(f.name) or "--" + f.name.replace("_", "-")


def field_flags(cls: type) -> dict[str, str]:
    """Parameter -> flag for the fields of dataclass ``cls`` and of its sections (a section's
    field by its dotted path, ``engine.name``, and by its own name unless two sections share it)."""
    out: dict[str, str] = {}
    shared: set[str] = set()
    for f in dataclasses.fields(cls):
        if _is_section(cls, f):
            for name, flag in field_flags(_resolve(cls, f.name)).items():
                out[f"{f.name}.{name}"] = flag
                if name in out and out[name] != flag:
                    shared.add(name)
                out.setdefault(name, flag)
        else:
            out[f.name] = _flag(cls, f)
    return {k: v for k, v in out.items() if k not in shared}


def name_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with every parameter in ``flags`` it names (``name=value``, or ```name```; a
    section's field by its dotted path, ``engine.name=...``) written as its flag."""

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in flags:
            return m.group(0)
        return flags[name] + ("=" if m.group(2) else "")

    # name=value only where a clause starts (after a space, a bracket or a comma): not inside a path
    return re.sub(r"`(\w+(?:\.\w+)*)`|(?<![^\s(\[,;])(\w+(?:\.\w+)*)=(?!=)", sub, message)


def _is_section(cls: type, f: dataclasses.Field) -> bool:
    return dataclasses.is_dataclass(_resolve(cls, f.name))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def add_config_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                         fields: Iterable[str] | None = None, exclude: Iterable[str] = (),
                         defaults: Mapping[str, Any] | None = None, _prefix: str = "",
                         _instance: Any = None) -> None:
    """One option per field of dataclass ``cls`` (those in ``fields``, if given, but not in
    ``exclude``); ``defaults`` overrides a field's default for this command. A field that is
    itself a dataclass (a section: ``engine``, ``optim``) adds its fields' options, named by
    their dotted path in ``fields``, ``exclude`` and ``defaults`` (``"optim.lr"``); the
    section's own default instance gives their defaults, and ``metadata={"fields": (...)}`` on
    the section's field limits them to those names (``{"exclude": (...)}`` leaves those out). A
    field with ``metadata={"cli": False}`` has no option, one with ``metadata={"required": True}`` must be given, one with
    ``metadata={"positional": "METAVAR"}`` is a positional argument; one with
    ``metadata={"derived": True}`` (a default computed from other
    fields when it is None) defaults to None."""
    docs = field_docs(cls)
    flags = field_flags(cls)
    wanted = set(fields) if fields is not None else None
    skip = set(exclude)
    defaults = dict(defaults or {})
    absent = {f.name for f in dataclasses.fields(cls) if not _is_section(cls, f)
              and (f.metadata.get("cli") is False or _prefix + f.name in skip
                   or (wanted is not None and _prefix + f.name not in wanted))}
    for f in dataclasses.fields(cls):
        path = _prefix + f.name
        if f.metadata.get("cli") is False or path in skip:
            continue
        if _is_section(cls, f):
            inner = getattr(_instance, f.name) if _instance is not None else _default(f)
            inner_fields = fields
            if "fields" in f.metadata:
                own = {path + "." + name for name in f.metadata["fields"]}
                inner_fields = own if fields is None else own & set(fields)
            inner_exclude = [*exclude, *(path + "." + name for name in f.metadata.get("exclude", ()))]
            group = parser.add_argument_group(path) if isinstance(parser, argparse.ArgumentParser) else parser
            add_config_arguments(group, _resolve(cls, f.name), fields=inner_fields, exclude=inner_exclude,
                                 defaults=defaults, _prefix=path + ".", _instance=inner)
            continue
        if wanted is not None and path not in wanted:
            continue
        flag = _flag(cls, f)
        if path in defaults:
            default = defaults[path]
        elif f.metadata.get("derived"):
            default = None
        elif _instance is not None:
            default = getattr(_instance, f.name)
        else:
            default = _default(f)
        kind, choices, _ = _parse_type(_resolve(cls, f.name))
        if "choices" in f.metadata:
            choices = tuple(f.metadata["choices"]())
        help_text = _help(docs.get(f.name, ""), flags, absent)
        kwargs: dict[str, Any] = {"dest": path, "default": default}
        if f.metadata.get("positional"):
            parser.add_argument(path, type=kind, metavar=f.metadata["positional"], help=help_text.replace("%", "%%"))
            continue
        if f.metadata.get("required"):
            kwargs["required"] = True
        if kind is bool:  # a switch; one that is on by default also has its --no- form
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
            text = help_text
        else:
            kwargs["type"] = kind
            kwargs["metavar"] = f.metadata.get("metavar") or flag.lstrip("-").upper().replace("-", "_")
            if choices:
                kwargs["choices"] = choices
            shown = _shown(default)
            if default is None or shown == "":
                text = help_text
            else:
                text = f"{help_text.rstrip('.')} (default {shown})"
        kwargs["help"] = text.replace("%", "%%")
        parser.add_argument(flag, **kwargs)


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of dataclass ``cls`` from the parsed options of its fields, with
    ``overrides`` (by field name). A section starts from its field's default instance and takes
    the options the command offers for it, so a command offering only some of its options keeps
    the rest of that default."""
    return _from_args(cls, args, "", None, overrides)


def _from_args(cls: type, args: argparse.Namespace, prefix: str, base: Any, overrides: Mapping[str, Any]) -> Any:
    values = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif _is_section(cls, f):
            inner = getattr(base, f.name) if base is not None else _default(f)
            values[f.name] = _from_args(_resolve(cls, f.name), args, path + ".", inner, {})
        elif hasattr(args, path):
            values[f.name] = getattr(args, path)
        elif f.metadata.get("derived"):
            values[f.name] = None  # derived again from the fields the command sets
    try:
        return dataclasses.replace(base, **values) if base is not None else cls(**values)
    except ValueError as e:
        raise ValueError(name_flags(str(e), field_flags(cls))) from None


def add_command(sub: argparse._SubParsersAction, name: str, cls: type, run: Any, *, help: str,
                config_file: bool = False) -> argparse.ArgumentParser:
    """Subcommand ``name`` whose options are the fields of dataclass ``cls``
    (:func:`add_config_arguments`); it runs ``run(config)`` on the instance the parsed options
    make (:func:`config_from_args`) and exits with its return value if that is an int, else 0.
    ``config_file``: also take ``--config FILE.toml``."""
    p = sub.add_parser(name, help=help, description=help)
    add_config_arguments(p, cls)
    if config_file:
        add_config_file_argument(p)

    def func(args: argparse.Namespace) -> int:
        _check_excludes(p, cls, getattr(args, "_argv", ()))
        rc = run(config_from_args(cls, args))
        return rc if isinstance(rc, int) else 0

    p.set_defaults(func=func)
    return p


__all__ += ["add_command"]


def _check_excludes(parser: argparse.ArgumentParser, cls: type, argv, prefix: str = "") -> None:
    """Refuse, in one line, two flags given together where a field's metadata says
    ``{"excludes": "other_field"}`` (``--epochs`` and ``--steps``)."""
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}

    def given(flag: str) -> bool:
        return any(t == flag or t.startswith(flag + "=") for t in argv)

    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if _is_section(cls, f):
            _check_excludes(parser, _resolve(cls, f.name), argv, path + ".")
        elif f.metadata.get("excludes"):
            a, b = flags.get(path), flags.get(prefix + f.metadata["excludes"])
            if a and b and given(a) and given(b):
                raise ValueError(f"give {a} or {b}, not both")


def add_config_file_argument(parser: argparse.ArgumentParser) -> None:
    """``--config FILE.toml``: any of the command's flags as keys (``max-tokens = 4096`` or
    ``max_tokens = 4096``); flags given on the command line win. See :func:`apply_config_file`."""
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="a TOML file with any of these flags as keys (without --); command-line flags win")
    parser.set_defaults(_config_file_parser=parser)


def _config_path(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """If ``argv`` names ``--config FILE``, make FILE's keys the defaults of the subcommand's
    parser, so flags on the command line still win.

    Raises:
        ValueError: an unreadable file, an unknown key, or a value of the wrong type or out of
            its choices, named by key.
    """
    path = _config_path(argv)
    if path is None:
        return
    ns, _ = parser.parse_known_args(argv)
    sub = getattr(ns, "_config_file_parser", None)
    if sub is None:
        raise ValueError("--config is not an option of this command")
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML ({e})") from None
    by_flag = {}
    for action in sub._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and action.help != argparse.SUPPRESS and opt != "--config":
                by_flag[opt[2:]] = by_flag[opt[2:].replace("-", "_")] = action
    defaults = {}
    for key, value in data.items():
        action = by_flag.get(key)
        if action is None or isinstance(action, argparse._HelpAction):
            raise ValueError(f"--config {path}: unknown key {key!r} (keys are this command's flags without --)")
        if action.nargs == 0:  # a switch
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} must be true or false, got {value!r}")
        else:
            if isinstance(value, (dict, list)) or isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} must be a single value, got {value!r}")
            if action.type is not None:
                try:
                    value = action.type(value if action.type is not str else str(value))
                except (TypeError, ValueError):
                    raise ValueError(f"--config {path}: {key}={value!r} is not a {action.type.__name__}") from None
            if action.choices is not None and value not in action.choices:
                raise ValueError(f"--config {path}: {key}={value!r} is not one of {', '.join(map(str, action.choices))}")
        defaults[action.dest] = value
    sub.set_defaults(**defaults)


__all__ += ["add_config_file_argument", "apply_config_file"]
