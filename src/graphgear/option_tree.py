"""The validated option tree under :class:`~graphgear.config.CompilerConfig`: a leaf
:class:`Option` checks each value assigned to it, and a :class:`Section` holds options
and sub-sections, with values on the instance (two configs never share state). The
concrete sections, one per concern, are in :mod:`graphgear.config`."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from .errors import ConfigError

__all__ = ["Option", "Section", "did_you_mean"]


class Option:
    """One validated leaf option.

    ``choices`` lists the allowed values; ``check`` is a predicate for open sets (its
    ``allowed`` text is shown in errors).
    """

    def __init__(
        self,
        default: Any,
        doc: str,
        *,
        choices: tuple[Any, ...] | None = None,
        check: Callable[[Any], bool] | None = None,
        allowed: str | None = None,
        explain: Callable[[Any], str | None] | None = None,
        convert: Callable[[Any], Any] | None = None,
    ) -> None:
        self.default = default
        self.doc = doc
        self.choices = choices
        self.check = check
        self.explain = explain  # what is wrong with a value (None: nothing), for errors
        self.convert = convert  # the stored form of a valid value
        self.allowed = allowed or (", ".join(repr(c) for c in choices) if choices else "any value")
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def validate(self, path: str, value: Any) -> Any:
        if self.choices is not None:
            # bool is an int: compare by type too so 1 is not accepted for True.
            if not any(value is c or (type(value) is type(c) and value == c) for c in self.choices):
                raise ConfigError(
                    f"graphgear: option {path!r} got {value!r}; allowed values: {self.allowed}."
                )
        elif self.check is not None and not self.check(value):
            raise ConfigError(
                f"graphgear: option {path!r} got {value!r}; allowed values: {self.allowed}."
            )
        if self.explain is not None and (problem := self.explain(value)) is not None:
            raise ConfigError(
                f"graphgear: option {path!r} got {value!r}: {problem}. Allowed values: {self.allowed}."
            )
        return self.convert(value) if self.convert is not None else value


class Section:
    """Base for one config section: options are class-level ``Option`` descriptors,
    sub-sections are class-level ``Section`` subclasses; values live in the instance."""

    _aliases: dict[str, str] = {}

    def __init__(self, _path: str = "") -> None:
        object.__setattr__(self, "_path", _path)
        values: dict[str, Any] = {}
        subs: dict[str, Section] = {}
        for name, opt in self._options().items():
            values[name] = copy.deepcopy(opt.default)
        for name, cls in self._sections().items():
            subs[name] = cls(f"{_path}{name}.")
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_subs", subs)

    @classmethod
    def _options(cls) -> dict[str, Option]:
        out: dict[str, Option] = {}
        for klass in reversed(cls.__mro__):
            for name, v in vars(klass).items():
                if isinstance(v, Option):
                    out[name] = v
        return out

    @classmethod
    def _sections(cls) -> dict[str, type[Section]]:
        out: dict[str, type[Section]] = {}
        for klass in reversed(cls.__mro__):
            for name, v in vars(klass).items():
                if isinstance(v, type) and issubclass(v, Section) and not name.startswith("_"):
                    out[name] = v
        return out

    def _known(self) -> list[str]:
        return sorted([*self._values, *self._subs, *self._aliases])

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            d = object.__getattribute__(self, "__dict__")
            if name in d.get("_values", {}):
                return d["_values"][name]
            if name in d.get("_subs", {}):
                return d["_subs"][name]
            aliases = type(self)._aliases
            if name in aliases:
                return d["_values"][aliases[name]]
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        name = self._aliases.get(name, name)
        if name in self._subs:
            raise ConfigError(
                f"graphgear: {self._path}{name} is a section, not an option; assign its "
                f"options instead, e.g. config.{self._path}{name}.<option> = value. "
                f"Options there: {', '.join(self._subs[name]._known())}."
            )
        if name not in self._values:
            torchair = {a: f"TorchAir's name of {self._path}{t}" for a, t in self._aliases.items()}
            raise ConfigError(
                f"graphgear: unknown option {self._path + name!r}; known options here: "
                f"{', '.join(self._known())}.{did_you_mean(name, self._known(), torchair)}"
            )
        opt = self._options()[name]
        self._values[name] = opt.validate(self._path + name, value)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """Yield ``(dotted_path, value)`` for every leaf option."""
        for name, value in self._values.items():
            yield self._path + name, value
        for sub in self._subs.values():
            yield from sub

    def as_dict(self) -> dict[str, Any]:
        """Nested plain dict of every option's value."""
        out: dict[str, Any] = dict(self._values)
        for name, sub in self._subs.items():
            out[name] = sub.as_dict()
        return out

    def _load(self, data: Mapping[str, Any]) -> None:
        for key, value in data.items():
            key = self._aliases.get(key, key)
            if key in self._subs:
                if not isinstance(value, Mapping):
                    raise ConfigError(
                        f"graphgear: {self._path}{key} is a section and needs a dict, got {value!r}."
                    )
                self._subs[key]._load(value)
            else:
                setattr(self, key, value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.as_dict() == other.as_dict()  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.as_dict()!r})"

    def __deepcopy__(self, memo: dict[int, Any]) -> Section:
        new = type(self)(self._path)
        new._load(self.as_dict())
        return new

    def copy(self) -> Any:
        """An independent copy."""
        return copy.deepcopy(self)


def did_you_mean(key: str, names: Iterable[str], targets: Mapping[str, str]) -> str:
    """`` Did you mean ...?`` naming the up to three ``names`` closest to ``key`` (each
    with ``targets[name]``, what it names, where given), or ``""`` when none is close."""
    close = difflib.get_close_matches(key, sorted(set(names)), n=3, cutoff=0.75)
    if not close:
        return ""
    described = [f"{c!r} ({targets[c]})" if c in targets else repr(c) for c in close]
    return f" Did you mean {' or '.join(described)}?"
