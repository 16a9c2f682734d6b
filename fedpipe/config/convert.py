"""Values to a setting's type (strings from ``--set``, TOML values, Flower's scalars), and
the one-line refusal of a mistyped setting's name."""

from __future__ import annotations

import difflib
from typing import Any, get_args, get_origin, get_type_hints

__all__ = ["coerce_field", "coerce_value", "unknown_setting"]

_BOOLS = {"1": True, "true": True, "yes": True, "on": True}
_BOOLS |= {"0": False, "false": False, "no": False, "off": False}


def unknown_setting(key: str, known: list[str]) -> str:
    """One line naming the closest known setting to a mistyped ``key``, else the choices."""
    section, _, name = key.partition(".")
    in_section = [k for k in known if k.startswith(section + ".")]
    if in_section:  # a known section: compare the key names alone
        names = [k.partition(".")[2] for k in in_section]
        close = [f"{section}.{n}" for n in difflib.get_close_matches(name, names, n=1)]
    else:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if close:
        return f"unknown setting {key!r}; did you mean {close[0]!r}?"
    choices = in_section or sorted({k.partition(".")[0] for k in known})
    return f"unknown setting {key!r}; known here: {', '.join(choices)}"


def coerce_field(cls: type, section: str, name: str, value: Any) -> Any:
    kind = get_type_hints(get_type_hints(cls)[section])[name]
    return coerce_value(f"{section}.{name}", kind, value)


def coerce_value(key: str, kind: Any, value: Any) -> Any:
    """``value`` as a ``kind`` (bool, int, float or str), from a string or a number; a value
    of another type is refused in one line naming ``key``.

    A list setting (``kind`` a tuple type) takes a list of entries, made a tuple, or one
    comma-separated string, kept whole: the setting's own section splits it (an inline
    profile spec keeps its commas there) and checks every entry."""
    if get_origin(kind) is tuple:
        return _coerce_list(key, kind, value)
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() not in _BOOLS:
                raise ValueError(f"{key} must be true or false, got {value!r}")
            return _BOOLS[text.lower()]
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"{key} must be {kind.__name__}, got {value!r}") from None
    if kind is float and isinstance(value, int):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind):
        raise ValueError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


def _coerce_list(key: str, kind: Any, value: Any) -> str | tuple[Any, ...]:
    """A list setting's value: a comma string as it is, a list or tuple as a tuple."""
    if isinstance(value, str):
        return value.strip()
    entry = get_args(kind)[0]  # str, or tuple[int, int] (a cut, also written "2+1")
    ok = (str,) if entry is str else (str, list, tuple)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, ok) for v in value):
        raise ValueError(
            f"{key} must be a list of strings or a comma-separated string, got {value!r}"
        )
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)
