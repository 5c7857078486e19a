"""Typed config machinery: frozen dataclasses <-> plain dicts, YAML presets, dotted overrides.

Every section of the run config is a frozen, keyword-only dataclass defined in this package
(pure Python, no JAX), so planning a cluster or validating a config never touches a device.
`build(cls, data, path)` turns nested dicts into dataclasses and rejects, with one line naming
the dotted key and the value:
  - unknown keys (the nearest valid name is suggested),
  - wrong types (a float field must be finite: inf and nan are refused),
and then calls each section's `validate()` (range and consistency checks).

Callers: `config.run.load_config` (CLI, launcher, tests).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    """A bad config value. `str(err)` is one line that names the dotted key and the value."""

    def __init__(self, key: str, value: Any, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"config error: {key}={value!r}: {why}")


def check(cond: bool, key: str, value: Any, why: str) -> None:
    """Raise ConfigError(key, value, why) unless `cond`."""
    if not cond:
        raise ConfigError(key, value, why)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; convert lists/dicts into tuples/dataclasses."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(key, value, f"must be one of {_type_name(tp)}")
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(key, value, f"must be {_type_name(tp)}, not null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(key, value, f"must be {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, value, f"must be a mapping for {tp.__name__}")
        return build(tp, value, key)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, value, f"must be a list ({_type_name(tp)})")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(key, value, f"must have {len(args)} entries ({_type_name(tp)})")
            return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, f"must be a mapping ({_type_name(tp)})")
        kt, vt = get_args(tp) or (Any, Any)
        return {_coerce(kt, k, f"{key}.{k}"): _coerce(vt, v, f"{key}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):  # PyYAML reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(key, value, "must be a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, value, "must be a number")
        if not math.isfinite(value):  # no field means anything by inf or nan (an lr of inf trains NaNs)
            raise ConfigError(key, value, "must be a finite number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(key, value, "must be an integer")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, value, "must be true or false")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, value, "must be a string")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(key, value, f"must be {_type_name(tp)}")
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def suggest(name: str, options: list[str]) -> str:
    """' (did you mean 'x'?)' for the closest option, or ''."""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


# Keys that were renamed or folded into another: one line naming the key to set instead.
REMOVED_KEYS = {
    "costmodel.attention": "removed: the cost model prices model.attention (xla: dense; cudnn, pallas: flash; "
    "auto: flash on an accelerator profile); set model.attention",
    "costmodel.kv_pool": "removed: the cost model prices the run's rollout.kv_pool; set rollout.kv_pool",
    "data.reward_modules": "moved: list the modules in the top-level `plugins:` (one key for every registry)",
    "pipeline.microbatches": "renamed: set pipeline.pieces (generation's streamed pieces; docs/reading.md "
    "tells the four micro-batch words apart)",
    "sharding.plugins": "moved: list the modules in the top-level `plugins:` (one key for every registry)",
}


def build(cls: type, data: dict[str, Any] | None, path: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, checking keys and types; calls `validate()`."""
    data = dict(data or {})
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in names:
            if dotted in REMOVED_KEYS:
                raise ConfigError(dotted, value, REMOVED_KEYS[dotted])
            raise ConfigError(dotted, value, "unknown key" + suggest(str(key), names))
        kwargs[key] = _coerce(hints[key], value, dotted)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain dicts/lists (YAML/JSON friendly)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def key(path: str, name: str) -> str:
    """Join a section path and a field name into a dotted key."""
    return f"{path}.{name}" if path else name
