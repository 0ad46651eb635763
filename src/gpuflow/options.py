"""Command-line flags, type checks and a flag reference generated from a config dataclass.

Each field declares its flag once, with :func:`option`: the help text and, only where the
annotation cannot say it, a metavar, the flag's name, how a value parses, what an unset
(``None``) value means and an argparse group. The type and the choices come from the
annotation (``Literal`` for choices), the default from the field. From that:

* :func:`add_flags` adds the argparse flags; their help ends with the field's default;
* :func:`check_types` checks values that came from a TOML file against the annotations,
  :func:`check_choices` the ``Literal`` fields against their choices;
* :func:`markdown_table` renders a parser's flags as the table in docs/cli.md
  (``python -m gpuflow.flagdoc``).

Why a small generator over argparse rather than tyro or jsonargparse: the command line is a
contract that this refactor must not change, and either library would change it. The
trainer relies on argparse's ``SUPPRESS`` defaults (a flag not given leaves the TOML file's
value, or a resumed run's saved one, in place), on argparse's error messages and exit code 2,
and on flag shapes that those libraries spell their own way: ``--batch-size N|auto``,
``--resume [DIR]``, ``--no-checkpoints`` for ``save_checkpoints`` and
``--reshard-after-forward/--no-reshard-after-forward``. tyro renders its own help and
negations (``--no-save-checkpoints``); jsonargparse brings a config-file layer of its own
beside the TOML one. Either would be a dependency doing what this module does in a page.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from gpuflow.errors import UserError

_KEY = "gpuflow.option"


@dataclass(frozen=True)
class Option:
    """What a field says about its flag beyond its type and default.

    ``help`` and ``details`` may hold Markdown code spans (backticks, dropped in ``--help``);
    ``details`` (links, longer explanations) appear in the reference table only. ``unset``
    says what a ``None`` default means, shown where the default is. ``flag`` names the flag
    when it is not the field's name with dashes: a ``bool`` field that defaults to True and
    has a ``flag`` is switched off by it (``--no-checkpoints``); one without a flag gets
    ``--name`` and ``--no-name``.
    """

    help: str
    metavar: str | None = None
    flag: str | None = None
    parse: Callable[[str], Any] | None = None
    unset: str | None = None
    details: str | None = None
    group: str | None = None
    cli: bool = True


def option(default: Any = MISSING, *, help: str, default_factory: Any = MISSING,
           **declared: Any) -> Any:
    """A dataclass field that declares its command-line flag (see :class:`Option`)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_KEY: Option(help=help, **declared)})


@dataclass(frozen=True)
class _Type:
    """A field's annotation taken apart: plain types, ``Literal`` values, ``None`` allowed."""

    plain: tuple[type, ...]
    literals: tuple[Any, ...]
    optional: bool

    @property
    def names(self) -> str:
        words = [t.__name__ for t in self.plain] + [f'"{v}"' for v in self.literals]
        if not self.plain:  # only a Literal: the type of its values; choices are checked apart
            words = sorted({type(v).__name__ for v in self.literals})
        return " or ".join(words)


def _split(hint: Any) -> _Type:
    plain: list[type] = []
    literals: list[Any] = []
    optional = False
    parts = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    for part in parts:
        if part is type(None):
            optional = True
        elif get_origin(part) is Literal:
            literals.extend(get_args(part))
        elif part is Any:
            plain.append(object)
        else:
            plain.append(get_origin(part) or part)
    return _Type(tuple(plain), tuple(literals), optional)


@functools.cache
def _hints(cls: type) -> dict[str, _Type]:
    return {name: _split(hint) for name, hint in get_type_hints(cls).items()}


@dataclass(frozen=True)
class Flag:
    """One field's flag, as argparse and the reference table need it."""

    name: str  # the field
    option: Option
    kind: Literal["value", "optional", "switch", "negation", "both"]
    flag: str
    type: _Type
    default: Any

    @property
    def choices(self) -> tuple[Any, ...] | None:
        return self.type.literals if self.type.literals and not self.type.plain else None

    @property
    def parse(self) -> Callable[[str], Any] | None:
        if self.option.parse is not None or self.choices:
            return self.option.parse
        if self.type.literals:
            raise TypeError(f"{self.name}: a value of {self.type.names} needs option(parse=...)")
        if self.type.plain in ((int,), (float,)):
            return self.type.plain[0]
        return None

    @property
    def metavar(self) -> str | None:
        if self.option.metavar is not None:
            return self.option.metavar
        return {(int,): "N", (float,): "X"}.get(self.type.plain, self.name.upper())

    def default_text(self) -> str:
        """The default as the reference shows it (Markdown)."""
        if self.kind in ("switch", "negation"):
            return "off"
        if self.kind == "both":
            return "on" if self.default else "off"
        if self.default is None or self.default is False:
            return self.option.unset or ""
        if isinstance(self.default, str):
            return f"`{self.default}`"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


def flags(cls: type) -> list[Flag]:
    """The flags of ``cls``'s fields that declare one, in field order."""
    found = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(_KEY)
        if declared is None or not declared.cli:
            continue
        kind_of = _hints(cls)[f.name]
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        kind: Any = "value"
        if kind_of.plain == (bool,) and not kind_of.literals:
            kind = "switch" if not default else "negation" if declared.flag else "both"
        elif set(kind_of.plain) == {str, bool}:
            kind = "optional"
        found.append(Flag(f.name, declared, kind, declared.flag or f.name.replace("_", "-"),
                          kind_of, default))
    return found


def _plain(text: str) -> str:
    return text.replace("`", "")


def add_flags(parser: argparse.ArgumentParser, cls: type, only: str | None = None) -> None:
    """Add a flag for each of ``cls``'s declared fields to ``parser`` (those of group
    ``only``, where given: another command shares them).

    A flag that is not given sets nothing (``argparse.SUPPRESS``): the field's default, a
    config file or a saved run fills it in later, in that order of precedence.
    """
    groups: dict[str, Any] = {}
    for flag in flags(cls):
        group = flag.option.group
        if only is not None and group != only:
            continue
        target = parser if group is None else (
            groups.get(group) or groups.setdefault(group, parser.add_argument_group(group)))
        shown = _plain(flag.default_text())
        text = _plain(flag.option.help)
        if flag.kind in ("value", "optional", "both") and shown:
            text += f" (default: {shown})"
        spec: dict[str, Any] = {"dest": flag.name, "default": argparse.SUPPRESS,
                                "help": text.replace("%", "%%")}
        if flag.kind == "switch":
            spec["action"] = "store_true"
        elif flag.kind == "negation":
            spec["action"] = "store_false"
        elif flag.kind == "both":
            spec["action"] = argparse.BooleanOptionalAction
        elif flag.kind == "optional":
            spec.update(nargs="?", const=True, metavar=flag.metavar)
        else:
            spec.update(type=flag.parse, choices=flag.choices,
                        metavar=None if flag.choices else flag.metavar)
            spec = {k: v for k, v in spec.items() if v is not None}
        target.add_argument(f"--{flag.flag}", **spec)


def check_types(config: Any) -> None:
    """Values from a TOML file or a saved run must have their field's annotated type: say so
    plainly when they do not. An int is taken for a float (and made one); a bool is not an
    int. ``None`` is left to the checks of each value."""
    for f in dataclasses.fields(config):
        value, kind = getattr(config, f.name), _hints(type(config))[f.name]
        if value is None or any(value == v and type(value) is type(v) for v in kind.literals):
            continue
        if float in kind.plain and type(value) is int:
            setattr(config, f.name, float(value))
            continue
        allowed = kind.plain or tuple({type(v) for v in kind.literals})
        if isinstance(value, bool) and bool not in allowed:
            allowed = ()
        if not isinstance(value, allowed):
            raise UserError(f"`{f.name}` must be of type {kind.names} (got {value!r}).")


def check_choices(config: Any) -> None:
    """Each field annotated with a ``Literal`` holds one of its values (``None`` where the
    annotation allows it)."""
    for f in dataclasses.fields(config):
        kind, value = _hints(type(config))[f.name], getattr(config, f.name)
        if kind.plain or not kind.literals or (value is None and kind.optional):
            continue
        if value not in kind.literals:
            declared = f.metadata.get(_KEY)
            name = (declared and declared.flag) or f.name.replace("_", "-")
            raise UserError(f"--{name} must be one of {', '.join(map(str, kind.literals))} "
                            f"(got {value!r}).")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(parser: argparse.ArgumentParser, cls: type) -> str:
    """``parser``'s flags as Markdown tables, one per argument group: the flags of ``cls``'s
    fields from their declarations (with their TOML key), any other flag from its help."""
    by_field = {flag.name: flag for flag in flags(cls)}
    blocks = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = by_field.get(action.dest)
            if flag is None:
                name = " ".join(s for s in (action.option_strings[-1], action.metavar) if s)
                rows.append((f"`{name}`", "", "", (action.help or "").replace("%%", "%")))
                continue
            shape = {"value": "|".join(map(str, flag.choices)) if flag.choices else flag.metavar,
                     "optional": f"[{flag.metavar}]"}.get(flag.kind, "")
            name = f"`--{flag.flag}{' ' + shape if shape else ''}`"
            if flag.kind == "both":
                name += f" / `--no-{flag.flag}`"
            key = flag.name.replace("_", "-")
            key = f"`{key} = false`" if flag.kind == "negation" else f"`{key}`"
            meaning = flag.option.help + (f"; {flag.option.details}" if flag.option.details
                                          else "")
            rows.append((name, key, flag.default_text(), meaning))
        if not rows:
            continue
        lines = [] if group.title in ("options", "optional arguments") else [
            f"**{group.title[:1].upper()}{group.title[1:]}**", ""]
        lines += ["| flag | TOML key | default | meaning |", "|---|---|---|---|"]
        lines += [f"| {' | '.join(_cell(c) for c in row)} |" for row in rows]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
