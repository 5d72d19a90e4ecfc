"""Typed, checked configs from YAML: the machinery under the trainer's config (model/config.py)
and the study's (tasks/config.py).

A config is a frozen dataclass of sections (:class:`SectionedConfig`), each a frozen dataclass
whose fields are declared with their meaning beside them. Variants are ``Literal`` names checked at
load; each section checks its own values in its ``check`` method, next to its fields; rules that
tie sections together go in the config's ``check_across``. Any problem raises :class:`ConfigError`
naming the dotted key or the file, before any work starts. Which value wins when params.yaml, a
profile and overrides disagree: :func:`resolve`. ``--set KEY=VALUE`` arguments: :func:`parse_sets`.

Pure Python + PyYAML: importable on a bare GPU box next to ``model/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, Union, get_args, get_origin

import yaml

PROFILES_DIR = "profiles"
"""Profile overlays live in ``<project>/profiles/<name>.yaml`` next to ``params.yaml``;
``default.yaml`` there is the default profile, under every other one."""


class UserError(ValueError):
    """A mistake the user can fix; the CLI prints it without a traceback and exits with code 2."""


class ConfigError(UserError):
    """A bad key or value in params.yaml or a profile overlay; the message names the dotted key."""


class InputError(UserError):
    """A missing, empty or malformed input file; the message names the file (and key)."""


# --------------------------------------------------------------------------------------------
# Checks a section runs on its own fields
# --------------------------------------------------------------------------------------------


def positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key}: must be > 0, got {value!r}")


def non_negative(key: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{key}: must be >= 0, got {value!r}")


def in_open_unit(key: str, value: float) -> None:
    if not 0 < value < 1:
        raise ConfigError(f"{key}: must be in (0, 1), got {value!r}")


def not_empty(key: str, values: list[Any]) -> None:
    if not values:
        raise ConfigError(f"{key}: must not be empty")


# --------------------------------------------------------------------------------------------
# A config of sections
# --------------------------------------------------------------------------------------------

C = TypeVar("C", bound="SectionedConfig")
T = TypeVar("T")


SECRET_QUERY_KEYS = ("password", "passfile", "sslpassword")
"""libpq's connection parameters that carry a password or name a file of them."""
USER_INFO_PASSWORD = re.compile(r"[\w+.-]+://[^:/]*:[^@]*@")
"""A password in the user info as SQLAlchemy reads it (up to the first ``@``), which may hold ``/``,
``?`` or ``#`` where ``urlsplit`` sees the host end and finds none."""


def no_password(key: str, url: str) -> None:
    """A database URL without a password in any part of it (the user info, or a ``password=``,
    ``passfile=`` or ``sslpassword=`` query parameter): configs are tracked by git and command lines
    are readable by every local user. The message never repeats the URL."""
    parts = urllib.parse.urlsplit(url)
    query = {k.lower() for k, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)}
    if parts.password is not None or USER_INFO_PASSWORD.match(url) or query & set(SECRET_QUERY_KEYS):
        raise ConfigError(
            f"{key}: the URL carries a password; remove it and put the password in the environment "
            "(PGPASSWORD) or a password file outside git (~/.pgpass, or the file PGPASSFILE names), "
            "which PostgreSQL's clients read themselves"
        )


class Section:
    """A section of a config (a frozen dataclass): it checks its own fields, beside them."""

    def check(self) -> None:
        """Raise ConfigError naming the dotted key of a value this section cannot take."""


@dataclass(frozen=True)
class SectionedConfig:
    """A config whose fields are sections (dataclasses with a ``check`` method) plus the profile."""

    profile: str = "default"
    """Name of the overlay in ``profiles/`` applied over params.yaml (``default`` = none)."""

    def validate(self: C) -> C:
        """Every section's own checks, then the rules across sections; raises ConfigError naming the key."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if isinstance(section, Section):
                section.check()
        self.check_across()
        return self

    def check_across(self) -> None:
        """Rules that tie two sections together (none here)."""

    def to_flat_dict(self) -> dict[str, Any]:
        """``{"optim.lr": 0.003, ...}``: the resolved config as MLflow params."""
        return flatten(dataclasses.asdict(self))

    def replace(self: C, **dotted: Any) -> C:
        """A copy with dotted keys overridden and re-validated: ``cfg.replace(**{"optim.lr": 1e-3})``."""
        return from_dict(type(self), _deep_merge(dataclasses.asdict(self), _unflatten(dotted)), "override")


# --------------------------------------------------------------------------------------------
# Loading: YAML -> typed, checked dataclasses
# --------------------------------------------------------------------------------------------


def add_config_arguments(parser: argparse.ArgumentParser, params: bool = True) -> None:
    """The config options every command that runs something takes: ``--params`` (unless the
    command finds the project itself), ``--profile`` and repeatable ``--set KEY=VALUE``
    (read with :func:`parse_sets`)."""
    if params:
        parser.add_argument("--params", default="params.yaml", help="params.yaml (default: %(default)s)")
    parser.add_argument(
        "--profile", default=None, help="profile overlay from profiles/ (default: the params file's `profile` key)"
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a dotted config key for this run, e.g. optim.lr=0.02, typed as the key is (repeatable)",
    )


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """``--set key=value`` arguments (the CLI's, the trainer's, an arm's) as dotted overrides.
    Values stay text: :func:`resolve` reads each as its key's type, YAML like ``dvc exp run -S``
    for numbers and lists, verbatim for string-typed keys."""
    sets = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected key=value, e.g. optim.lr=0.01")
        sets[key.strip()] = value
    return sets


@dataclass(frozen=True)
class Resolved(Generic[C]):
    """A config and where its values came from."""

    config: C
    from_profile: dict[str, Any]
    """Dotted keys whose value the profile overlay set (params.yaml holds the default profile's
    value there, so the profile's value applies)."""

    def notice(self) -> str:
        """One line naming the keys the profile set, or ``""`` under the default profile."""
        if not self.from_profile:
            return ""
        pairs = ", ".join(f"{k}={v!r}" for k, v in sorted(self.from_profile.items()))
        return (
            f"profile {self.config.profile!r} set {len(self.from_profile)} keys: {pairs}. A value in "
            f"params.yaml equal to the default profile's does not override them; to run one of "
            f"these keys at that value, change the profile file or pass it as an override"
        )


def resolve(
    schema: type[C],
    params: str | Path = "params.yaml",
    profile: str | None = None,
    overrides: dict[str, Any] | None = None,
    own_sections_only: bool = False,
) -> Resolved[C]:
    """Resolve a ``schema`` config from its files; each value comes from the first source that sets it:

    1. ``overrides`` (dotted keys; strings are read as YAML like ``dvc exp run -S``, except for
       string-typed keys);
    2. **explicit** values of ``params``: those that differ from the default profile's;
    3. the profile overlay ``profiles/<profile>.yaml`` (none for ``default``);
    4. the default profile: the declared defaults, changed by ``profiles/default.yaml`` where
       that file exists.

    ``own_sections_only``: the files' sections that ``schema`` does not declare are passed over,
    unread (the trainer reads its sections of the study's params.yaml); overrides never are.

    Why "explicit" means "differs from the default profile": ``dvc exp run -S key=value`` can
    only write into params.yaml (and only keys already there), so params.yaml lists every key at
    its default-profile value (a test keeps it so) and a value the user changed is told apart
    from the file's own default by comparing the two. Both come from files, never from git
    history, so the result (and DVC's cache of it) is a function of the files alone. The one
    case this rule cannot see: a key set back to its default-profile value under another
    profile; the profile's value applies and :meth:`Resolved.notice` names every key the
    profile set.
    """
    params = Path(params)
    keep = _own_sections(schema) if own_sections_only else None
    raw = _sections(_read_yaml(params, "params file"), keep)
    _typecheck(schema, raw, "", str(params), partial=True)
    overridden = _typed(schema, _read_overrides(schema, overrides or {}))
    name = _profile_name(params, raw, profile, overridden.get("profile"))
    profiles = params.parent / PROFILES_DIR
    default_profile = _default_profile(schema, profiles / "default.yaml", keep)
    explicit = {k: v for k, v in _typed(schema, raw).items() if k != "profile" and v != default_profile[k]}
    overlay = _typed(schema, _read_overlay(schema, profiles / f"{name}.yaml", keep)) if name != "default" else {}
    from_profile = {k: v for k, v in overlay.items() if k not in explicit and k not in overridden}
    values = {**default_profile, **from_profile, **explicit, **overridden, "profile": name}
    return Resolved(from_dict(schema, _unflatten(values), str(params)), from_profile)


def from_dict(schema: type[C], raw: dict[str, Any], source: str = "<dict>") -> C:
    """Build and validate a ``schema`` config from a nested dict; missing keys take their defaults."""
    _typecheck(schema, raw, "", source, partial=True)
    return _build(schema, raw).validate()


def _own_sections(schema: type) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def _sections(raw: dict[str, Any], keep: set[str] | None) -> dict[str, Any]:
    return raw if keep is None else {k: v for k, v in raw.items() if k in keep}


def _profile_name(params: Path, raw: dict[str, Any], profile: str | None, chosen: str | None) -> str:
    """The profile named by the argument, else the overrides, else params.yaml, else ``default``."""
    if profile is not None and chosen is not None and profile != chosen:
        raise ConfigError(f"profile: given twice, {profile!r} and {chosen!r} in the overrides")
    name = profile or chosen or raw.get("profile", "default")
    if not isinstance(name, str):
        raise ConfigError(f"profile: must be a string, got {name!r} ({params})")
    known = ["default", *sorted(p.stem for p in (params.parent / PROFILES_DIR).glob("*.yaml") if p.stem != "default")]
    if name not in known:
        raise ConfigError(
            f"profile: unknown profile {name!r}; allowed: {', '.join(known)} "
            f"(no file {params.parent / PROFILES_DIR / f'{name}.yaml'})"
        )
    return name


def _default_profile(schema: type, overlay: Path, keep: set[str] | None) -> dict[str, Any]:
    """Every dotted key at the default profile's value: the declared defaults, changed by ``overlay``."""
    config = _build(schema, _read_overlay(schema, overlay, keep)) if overlay.is_file() else schema()
    return flatten(dataclasses.asdict(config))


def _read_overlay(schema: type, path: Path, keep: set[str] | None) -> dict[str, Any]:
    overlay = _read_yaml(path, "profile")
    if "profile" in overlay:
        raise ConfigError(f"profile: not allowed inside a profile ({path})")
    overlay = _sections(overlay, keep)
    _typecheck(schema, overlay, "", str(path), partial=True)
    return overlay


def _read_overrides(schema: type, overrides: dict[str, Any]) -> dict[str, Any]:
    nested = _unflatten({key: override_value(schema, key, value) for key, value in overrides.items()})
    _typecheck(schema, nested, "", "overrides", partial=True)
    return nested


def override_value(schema: type, key: str, value: Any) -> Any:
    """A command-line string as the key's type reads it: ``"100"`` -> 100, ``"[16, 32]"`` -> a list."""
    if not isinstance(value, str) or _declared_type(schema, key) in (str, None):
        return value
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value  # the type check names the key


def annotation(schema: type, key: str) -> Any:
    """The annotation of a dotted key of ``schema`` as declared (a section's is its dataclass), or
    None for an unknown key."""
    cls: Any = schema
    for part in key.split("."):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def _declared_type(schema: type, key: str) -> Any:
    """The annotation of a dotted key (``str`` for string variants), or None for an unknown key."""
    cls = annotation(schema, key)
    if get_origin(cls) is Literal and all(isinstance(a, str) for a in get_args(cls)):
        return str
    return cls


def _typed(schema: type, raw: dict[str, Any]) -> dict[str, Any]:
    """The dotted keys ``raw`` sets, valued as the config types them (``"3e-4"`` -> 3e-4)."""
    built = flatten(dataclasses.asdict(_build(schema, raw)))
    return {key: built[key] for key in flatten(raw)}


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    """A non-empty mapping from ``path``. PyYAML keeps the last of two equal keys without a word,
    so the document's nodes are checked for duplicates before they are turned into values."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    loader = yaml.SafeLoader(path.read_text(encoding="utf-8"))
    try:
        node, data = loader.get_single_node(), None
        if node is not None:  # a file of comments only has none
            reject_duplicate_keys(node, path)
            data = loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    finally:
        loader.dispose()
    if data is None or data == {}:
        raise ConfigError(f"{path}: empty {what}; it must set at least one key")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def reject_duplicate_keys(node: yaml.Node, path: Path | str, prefix: str = "") -> None:
    """Refuse a key written twice at any depth (in lists' entries too), naming it and its lines:
    PyYAML would keep only the last without a word."""
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            reject_duplicate_keys(item, path, f"{prefix.rstrip('.')}[{index}].")
        return
    if not isinstance(node, yaml.MappingNode):
        return
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key in first_line:
            raise ConfigError(
                f"{key}: duplicate key in {path} (lines {first_line[key]} and {line}); "
                f"YAML would silently keep only the last"
            )
        first_line[key] = line
        reject_duplicate_keys(value_node, path, f"{key}.")


def _typecheck(cls: type, raw: Any, prefix: str, source: str, partial: bool) -> None:
    """Reject unknown keys and values of the wrong type, naming the dotted key."""
    where = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(raw).__name__} ({source})")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{dotted}: unknown key ({source}); allowed: {', '.join(names)}")
        hint = hints[key]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a section (an annotation is a class)
            _typecheck(hint, value, f"{dotted}.", source, partial)
        else:
            _check_type(dotted, hint, value, source)


def _check_type(key: str, hint: Any, value: Any, source: str) -> None:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))} ({source})")
    elif origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be a list, got {value!r} ({source})")
        for i, item in enumerate(value):
            _check_type(f"{key}[{i}]", args[0], item, source)
    elif origin in (Union, types.UnionType):
        if not any(_matches(a, value) for a in args):
            raise ConfigError(f"{key}: {value!r} does not match {hint} ({source})")
    elif not _matches(hint, value):
        raise ConfigError(f"{key}: must be {hint.__name__}, got {type(value).__name__} {value!r} ({source})")


def _matches(hint: Any, value: Any) -> bool:
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        number = _as_float(value)
        return number is not None and math.isfinite(number)
    return isinstance(value, hint)


def _as_float(value: Any) -> float | None:
    """Ints, floats, and numeric strings: PyYAML (YAML 1.1) reads ``3e-4`` as a string, DVC does not."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _build(cls: type[T], raw: dict[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        hint = hints[key]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a section (an annotation is a class)
            value = _build(hint, value)
        elif hint is float:
            value = _as_float(value)
        elif get_origin(hint) is list and get_args(hint)[0] is float:
            value = [_as_float(v) for v in value]
        kwargs[key] = value
    return cls(**kwargs)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _unflatten(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
