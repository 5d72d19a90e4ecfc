"""Typed parameter forms for the Prefect UI, generated from the config so they cannot drift:
``Profile`` is a choice among the overlays in ``profiles/``; ``Overrides`` holds the keys a user
sets for an ablation arm, typed as declared in the config (tasks/config.py names where each
section lives) and described by the docstring written under each field there. Choices default
to ``KEEP`` (params.yaml's value), other fields to empty.

A run started from the UI or the API runs as the owner of the served project, whoever asked for it,
so what it may set is bounded (:func:`check_from_outside`): numbers, flags and choices, but none that
loads compiled code from a cache (``train.compile``); a path only inside the project, never a URL
(what the reader would open is checked, symlinks followed); no text key that reaches the file system
or the network (storages, scheduler addresses, data sets, experiment names)."""

from __future__ import annotations

import ast
import dataclasses
import glob
import inspect
import os
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, create_model

from model.typed_config import PROFILES_DIR, ConfigError, annotation, flatten
from tasks.config import Config
from tasks.data.config import DataConfig
from tasks.runtime.paths import project_dir, state_dir

FORM_KEYS = {
    "model": ["block", "norm", "mlp", "qk_norm", "z_loss"],
    "mup": ["parametrization"],
    "optim": ["lr", "beta2", "eps", "weight_decay", "grad_clip"],
    "precision": ["mode"],
    "train": ["steps", "seed"],
}
"""What the form offers, section by section (any other key: the free-form ``overrides``)."""
PROJECT_PATHS = ("data.path",)
"""Text keys a run from outside may set, to a path inside the project folder."""


def profile_names() -> tuple[str, ...]:
    overlays = sorted(p.stem for p in (project_dir() / PROFILES_DIR).glob("*.yaml"))
    return ("default", *(name for name in overlays if name != "default"))


KEEP = "as in params.yaml"
if TYPE_CHECKING:  # the choices below are read from profiles/ when this runs: to a type checker, a name
    Profile = str
    ProfileChoice = str
else:
    Profile = Literal[profile_names()]
    """The profiles present in this project, as a choice."""
    ProfileChoice = Literal[(KEEP, *profile_names())]
    """A form's profile field: a profile, or keep the one params.yaml names (the default)."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass, as plain text (markdown quotes)."""
    (class_def,) = ast.parse(inspect.getsource(cls)).body
    assert isinstance(class_def, ast.ClassDef)  # the source of a class
    body = class_def.body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split()).replace("``", "`")
    return docs


def _form_field(hint: Any, description: str | None) -> tuple[Any, Any]:
    """A choice (a select) keeps params.yaml's value by default; any other field is empty (None)."""
    if typing.get_origin(hint) is Literal:
        return Literal[(KEEP, *typing.get_args(hint))], Field(KEEP, description=description)
    return hint | None, Field(None, description=description)


def _section_model(section: str, keys: list[str]) -> type[BaseModel]:
    cls = typing.get_type_hints(Config)[section]
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    fields: dict[str, Any] = {key: _form_field(hints[key], docs.get(key)) for key in keys}
    return create_model(f"{section.capitalize()}Overrides", __config__=ConfigDict(extra="forbid"), **fields)


def _overrides_model() -> type[BaseModel]:
    sections = {section: _section_model(section, keys) for section, keys in FORM_KEYS.items()}
    fields: dict[str, Any] = {
        section: (model, Field(default_factory=model, description=f"The `{section}` keys."))
        for section, model in sections.items()
    }
    return create_model(
        "Overrides",
        __config__=ConfigDict(extra="forbid"),
        __doc__="Values that override params.yaml and the profile for this run; empty fields keep them.",
        **fields,
    )


def __getattr__(name: str) -> Any:
    """``Overrides``, the pipeline's form model, is built on first use (it parses the config's source
    for the field docs: a tenth of a second or more that the stage flows, which take only
    ``Profile``, do not pay)."""
    if name == "Overrides":
        globals()[name] = model = _overrides_model()
        return model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dotted(overrides: BaseModel | None, free_form: dict[str, Any] | None = None) -> dict[str, Any]:
    """The form's filled-in fields and the free-form entries as flat dotted keys,
    ``{"optim.lr": 0.01, ...}`` (a free-form section, ``{"search": {...}}``, is flattened too: each
    key is then checked, and params.yaml keeps the section's other keys)."""
    keys = {
        f"{section}.{key}": value
        for section, values in (overrides.model_dump() if overrides else {}).items()
        for key, value in values.items()
        if value not in (None, KEEP)
    }
    return flatten({**keys, **(free_form or {})})


def check_from_outside(sets: dict[str, Any], project: Path) -> None:
    """Refuse what a run started from the UI or the API may not set, naming the key: a key of
    :data:`LOADS_CACHED_CODE`; a key whose type holds text (a storage, an address, a data set: it
    reaches the file system or the network as the owner), unless it is a path of
    :data:`PROJECT_PATHS` whose every file the reader would open lies inside ``project``
    (:func:`why_not_inside`); a profile that is not one of the overlays. Numbers, flags and
    choices pass; their values are checked with the config, which also refuses an unknown key by
    name."""
    for key, value in flatten(sets).items():
        hint = annotation(Config, key)  # None for an unknown key
        if dataclasses.is_dataclass(hint):  # a section as text, which the config reads as YAML
            raise ConfigError(f"{key}: a section; give its keys one by one ({key}.<key>)")
        if key == "profile":
            if value in profile_names():
                continue
            raise ConfigError(f"profile: {value!r} is not one of {', '.join(profile_names())}")
        if key in LOADS_CACHED_CODE:
            raise refused(key, "it makes the project's owner load compiled code from a cache", FROM_A_SHELL)
        if not carries_text(hint):
            continue
        if key not in PROJECT_PATHS:
            raise refused(
                key,
                "a text key: storages, addresses and data sets reach the file system or the network as the "
                "project's owner",
                FROM_A_SHELL,
            )
        why = why_not_inside(project, str(value))
        if why:
            raise refused(key, why, INSIDE_THE_PROJECT)


LOADS_CACHED_CODE = ("train.compile",)
"""Flags and choices a run from outside may not set either: they make the owner load compiled or
pickled code from a cache (``torch.compile``: Inductor's compiled kernels and pickled graphs, by
default under /tmp/torchinductor_<user>). Set in params.yaml or a profile, they are the owner's."""
FROM_A_SHELL = "set in params.yaml from a shell"
INSIDE_THE_PROJECT = "a path inside the project folder, outside its hidden folders"
URL_MARKS = ("://", "::")
"""What fsspec reads as a URL (``file://``, ``http://``, DVC's ``remote://``) or as a chain of file
systems (``simplecache::http://...``): the reader opens such a value wherever it points."""


def refused(key: str, why: str, only: str) -> ConfigError:
    return ConfigError(f"{key}: refused from a run started in the Prefect UI or API ({why}); only {only}")


def why_not_inside(project: Path, value: str) -> str | None:
    """Why the data reader, given ``value`` as ``data.path``, could open a file outside ``project``
    or in its hidden folders; None when it could not. What is checked is what the reader would
    open, not the string: the file system and path fsspec gives it, a glob's folder and matches,
    and every symlink under a folder it walks, each resolved (:func:`inside`)."""
    if any(mark in value for mark in URL_MARKS):
        return f"{value!r} is a URL or a chain of file systems, which the reader opens wherever it points"
    fs, path = reader_target(project, value)
    if not isinstance(fs, LocalFileSystem):
        return f"{value!r} is read through fsspec's {fs.protocol!r} file system, not from the project folder"
    try:
        escape = next((p for p in opened_paths(fs, path) if not inside(project, p)), None)
    except (OSError, ValueError, RuntimeError) as e:  # a null byte, a symlink loop, a folder it may not list
        return f"{value!r} cannot be followed: {e}"
    if escape is None:
        return None
    return f"{value!r} reaches {escape}, outside what it may read (symlinks followed)"


def reader_target(project: Path, value: str) -> tuple[AbstractFileSystem, str]:
    """The file system and path the data reader opens for ``data.path: value``, from the reader's
    own functions (imported here: they bring Prefect, which the stage flows' forms do not need)."""
    from tasks.data.sources import filesystem, location

    return filesystem(location(DataConfig(source="jsonl", path=value), project), project)


def opened_paths(fs: LocalFileSystem, path: str) -> Iterator[str]:
    """What the reader may open for ``path``: the path itself (a glob's pattern resolves as far as
    it exists, to the folder it searches: one outside is refused even while nothing in it matches),
    then a glob's matches, or every symlink under a folder (the reader walks a folder as fsspec's
    ``find`` does, into symlinked folders)."""
    yield path
    yield from fs.glob(path) if glob.has_magic(path) else symlinks_under(path)


def symlinks_under(folder: str) -> Iterator[str]:
    """Every symlink under ``folder`` (nothing for a file), symlinked folders walked too; each real
    folder once, so a link back up ends there instead of looping."""
    walked: set[Path] = set()
    for parent, folders, files in os.walk(folder, followlinks=True):
        real = Path(parent).resolve()
        if real in walked:
            folders.clear()
            continue
        walked.add(real)
        yield from (os.path.join(parent, n) for n in (*folders, *files) if os.path.islink(os.path.join(parent, n)))


def carries_text(hint: Any) -> bool:
    """``hint`` admits free text: ``str`` itself or inside ``X | None``, ``list[...]`` and the like
    (a ``Literal`` of strings is a choice, not text)."""
    if hint is str:
        return True
    return typing.get_origin(hint) is not Literal and any(carries_text(a) for a in typing.get_args(hint))


def inside(project: Path, path: str) -> bool:
    """``path`` (relative to ``project``) resolves, symlinks followed, to a place inside ``project``
    and outside its hidden folders (``.spikelab``: the login and the keys; ``.git``, ``.dvc``) and
    the state directory, wherever that lies; nor a folder holding the state directory, or the
    project itself (a folder of documents is read recursively)."""
    root, state = project.resolve(), state_dir()
    target = (root / path).resolve()
    if not target.is_relative_to(root) or target == root:
        return False
    if target.is_relative_to(state) or state.is_relative_to(target):
        return False
    return not any(part.startswith(".") for part in target.relative_to(root).parts)
