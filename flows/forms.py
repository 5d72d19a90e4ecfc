"""Typed parameter forms for the Prefect UI, generated from the config so they cannot drift:
``Profile`` is a choice among the overlays in ``profiles/``; ``Overrides`` holds the keys a user
sets for an ablation arm, typed as declared in the config (tasks/config.py names where each
section lives) and described by the docstring written under each field there. Choices default
to ``KEEP`` (params.yaml's value), other fields to empty.

A run started from the UI or the API runs as the owner of the served project, whoever asked for it,
so what it may set is bounded (:func:`check_from_outside`): numbers, flags and choices, but none that
loads compiled code from a cache (``train.compile``), and no whole number or list beyond its bound
(:data:`OUTSIDE_BOUNDS`: workers by this machine's cores, seeds, steps, sizes, counts); a path only
inside the project, never a URL (what the reader would open is checked, symlinks followed); no text
key that reaches the file system or the network (storages, scheduler addresses, data sets,
experiment names)."""

from __future__ import annotations

import ast
import dataclasses
import glob
import inspect
import os
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, create_model

from model.config import MAX_LOSS_SHIFT
from model.typed_config import PROFILES_DIR, ConfigError, annotation, flatten, override_value
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
    choices pass, each whole number and list within its bound (:func:`out_of_bounds`); their values
    are checked with the config, which also refuses an unknown key by name."""
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
            why = out_of_bounds(key, hint, value)
            if why:
                raise refused(key, why, f"up to its bound, more {FROM_A_SHELL}")
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


GENEROUS = 4
"""A count, a number of steps, a size or a number of bytes from outside may be this many times the
largest value the declared defaults and every profile in profiles/ give it (the gpu profile's, mostly)."""
PER_CORE = 2
"""Worker processes and threads from outside: at most this many per core this process may run on
(tasks/runtime/workers.py: available_cores, what 0 means for them); more only wait for a core, each
process holding its own copy of torch. Two, not one: the gpu profile's 4 arms share one GPU on a
2-core machine."""
SEED_MOST = 9_999
"""The largest seed from outside: every seed the project has used lies far below it (the seed
registry's reach 202, the profiles' study seeds 27, the sizing seeds 103, ``data.seed`` 1234), with
room for many versions of fresh study seeds (the registry refuses a used one)."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """The largest whole number a run from outside may set a key to (each entry of a list), or
    None for a list of floats (rates, fractions: no work grows with them); and for a list, the most
    entries (every entry is another arm, trial or origin run)."""

    most: int | Callable[[], int] | None
    why: str
    entries: int | None = None

    def largest(self) -> int | None:
        return self.most() if callable(self.most) else self.most


def per_core() -> int:
    """:data:`PER_CORE` times the cores this process may run on (its affinity)."""
    from tasks.runtime.workers import available_cores

    return PER_CORE * available_cores()


def profiles(largest: int | None, entries: int | None = None) -> Bound:
    """:data:`GENEROUS` times ``largest``, the largest value the profiles give the key (for a list:
    each entry's, and ``entries``, its most entries)."""
    return Bound(
        None if largest is None else GENEROUS * largest,
        f"{GENEROUS}x the largest the profiles set",
        None if entries is None else GENEROUS * entries,
    )


def seeds(entries: int) -> Bound:
    """A list of seeds: each at most :data:`SEED_MOST`, :data:`GENEROUS` times the profiles' most entries."""
    return Bound(SEED_MOST, f"seeds up to {SEED_MOST}, entries {GENEROUS}x the profiles' most", GENEROUS * entries)


def below(key: str) -> Callable[[], int]:
    """One less than ``key``'s bound: for a key the config keeps below ``key``'s value."""

    def most() -> int:
        largest = OUTSIDE_BOUNDS[key].largest()
        assert largest is not None, key  # a whole number's bound
        return largest - 1

    return most


WORKERS = Bound(per_core, f"{PER_CORE} per core this process may run on")
SEED = Bound(SEED_MOST, "every seed the project uses lies far below")

OUTSIDE_BOUNDS: dict[str, Bound] = {
    # The numbers in profiles(...) are the largest the declared defaults and profiles/ give the key
    # (default, extended, gpu, smoke); tests/test_forms.py checks that every profile fits.
    "tokenizer.vocab_size": profiles(50_304),
    "tokenizer.min_frequency": profiles(2),
    "model.n_layer": profiles(12),
    "model.n_head": profiles(12),
    "model.d_model": profiles(768),
    "model.seq_len": profiles(1024),
    "mup.base_width": profiles(768),
    "schedule.warmup_steps": profiles(100),
    "precision.growth_interval": profiles(2000),
    "precision.loss_shift": Bound(MAX_LOSS_SHIFT, "fp16's range in binades"),
    "train.steps": profiles(5000),
    "train.batch_size": profiles(32),
    "train.grad_accum": profiles(4),
    "train.seed": SEED,
    "train.log_every": profiles(10),
    "train.layer_stats_every": profiles(100),
    "train.eval_every": profiles(500),
    "train.eval_batches": profiles(8),
    "train.num_workers": WORKERS,
    "train.cpu_threads": WORKERS,
    "train.diverge_after": profiles(20),
    "checkpoint.every_steps": profiles(1000),
    "checkpoint.keep_last": profiles(2),
    "checkpoint.milestones": profiles(5000, entries=6),
    "data.max_docs": Bound(1_000_000, "a cap (0: every document), far above any built-in corpus"),
    "data.max_doc_bytes": profiles(4 * 2**20),
    "data.seed": SEED,
    "data.shard_bytes": profiles(64 * 2**20),
    "data.workers": WORKERS,
    "data.tokenizer_sample_bytes": profiles(256 * 2**20),
    "filter.min_chars": profiles(64),
    "filter.max_chars": profiles(200_000),
    "filter.max_char_run": profiles(200),
    "filter.ngram_max_period": profiles(13),
    "filter.ngram_min_repeats": profiles(32),
    "filter.dedup_num_perm": profiles(128),
    "filter.dedup_shingle": profiles(5),
    "filter.perplexity_sample_bytes": profiles(64 * 2**20),
    "filter.poison_generated": profiles(64),
    "filter.poison_max_bytes": profiles(16 * 2**20),
    "spike.seeds": seeds(4),
    "spike.confirm_seeds": seeds(8),
    "spike.run_steps": profiles(1200),
    "spike.origin_step": profiles(600),
    "spike.warm_steps": profiles(128),
    "spike.workers": WORKERS,
    "spike.duration": profiles(3),
    "spike.poison_batches_range": profiles(400, entries=2),
    "spike.poison_ramp_batches": profiles(64),
    "spike.param_block": Bound(below("ablation.n_layer"), "a block of the arm model, below ablation.n_layer's bound"),
    "spike.detect_window": profiles(128),
    "spike.detect_warmup": profiles(64),
    "spike.detect_lag": profiles(32),
    "spike.sizing_seeds": seeds(4),
    "spike.sizing_zscores": profiles(None, entries=10),
    "spike.sizing_ramps": profiles(64, entries=7),
    "spike.detect_within": profiles(100),
    "spike.min_origins_per_half": profiles(2),
    "spike.sample_prompts": profiles(4),
    "spike.sample_tokens": profiles(32),
    "recovery.skip_batches": profiles(200),
    "recovery.rollback_steps": profiles(100),
    "recovery.max_retries": profiles(2),
    "recovery.max_consecutive_vetoes": profiles(4),
    "recovery.checkpoint_every": profiles(10),
    "recovery.eval_steps": profiles(500),
    "recovery.recover_steps": profiles(100),
    "recovery.smooth_steps": profiles(10),
    "search.widths": profiles(768, entries=3),
    "search.lr_points": profiles(12),
    "search.refine_points": profiles(2),
    "search.seeds": seeds(3),
    "search.confirm_seeds": seeds(3),
    "search.steps": profiles(1200),
    "search.batch_size": profiles(4),
    "search.eval_every": profiles(100),
    "search.prune_startup_trials": profiles(3),
    "search.prune_warmup_steps": Bound(below("search.steps"), "below search.steps's bound"),
    "search.workers": WORKERS,
    "search.heartbeat_s": profiles(10),
    "ablation.seeds": seeds(4),
    "ablation.confirm_seeds": seeds(8),
    "ablation.rounds": profiles(12, entries=3),
    "ablation.budget_seeds": profiles(8),
    "ablation.d_model": profiles(256),
    "ablation.n_layer": profiles(4),
    "ablation.n_head": profiles(4),
    "ablation.seq_len": profiles(256),
    "ablation.batch_size": profiles(32),
    "ablation.steps": profiles(3000),
    "ablation.xiong_warmups": profiles(None, entries=2),
    "ablation.xiong_lrs": profiles(None, entries=2),
    "ablation.xiong_depth": profiles(12),
    "ablation.xiong_steps": profiles(2000),
    "ablation.sizing_seeds": seeds(4),
    "ablation.sizing_xiong_steps": profiles(1600, entries=4),
    "ablation.probe_depths": profiles(24, entries=7),
    "ablation.range_probe_every": profiles(100),
    "ablation.beta2s": profiles(None, entries=2),
    "ablation.beta2_lr_mults": profiles(None, entries=2),
    "ablation.beta2_steps": profiles(4000),
    "ablation.beta2_batch_size": profiles(4),
    "ablation.lrs": profiles(None, entries=7),
    "ablation.wortsman_steps": profiles(2000),
    "ablation.workers": WORKERS,
    "ablation.retries": profiles(1),
    "sensitivity.seed": SEED,
    "sensitivity.workers": WORKERS,
}
"""The bounds on every whole number and list a run from outside may set, each in this one place;
a list of choices needs none (at most one entry per choice: :func:`out_of_bounds`). A whole number
or list with no bound here is refused from outside. Floats (rates, fractions, thresholds,
multipliers) have none: no work grows with them, and the config checks their range."""


def is_choice(hint: Any) -> bool:
    return typing.get_origin(hint) is Literal


def out_of_bounds(key: str, hint: Any, value: Any) -> str | None:
    """Why ``value`` (read as the config reads an override: ``"100"`` is 100) is beyond ``key``'s
    bound (:data:`OUTSIDE_BOUNDS`), or None. A value of the wrong type is left to the config, which
    refuses it by name."""
    is_list = typing.get_origin(hint) is list
    if not (hint is int or is_list):
        return None  # a flag, a choice, a float, an unknown key
    value = override_value(Config, key, value)
    if is_list and is_choice(typing.get_args(hint)[0]):
        choices = len(typing.get_args(typing.get_args(hint)[0]))
        if isinstance(value, list) and len(value) > choices:
            return f"{len(value)} entries, above its bound {choices}: one per choice"
        return None
    bound = OUTSIDE_BOUNDS.get(key)
    if bound is None:
        return "a whole number or list with no bound for a run from outside (flows/forms.py: OUTSIDE_BOUNDS)"
    most = bound.largest()
    if not is_list:
        whole = isinstance(value, int) and not isinstance(value, bool)
        return (
            f"{shown(value)} is above its bound {most}: {bound.why}"
            if whole and most is not None and value > most
            else None
        )
    if not isinstance(value, list):
        return None
    if bound.entries is not None and len(value) > bound.entries:
        return f"{len(value)} entries, above its bound {bound.entries}: {bound.why}"
    for entry in value:
        if isinstance(entry, int) and not isinstance(entry, bool) and most is not None and entry > most:
            return f"entry {shown(entry)} is above its bound {most}: {bound.why}"
    return None


def shown(number: int) -> str:
    """``number`` as a message shows it: its digits, or its size where Python would refuse to
    write them (over 4,300 digits)."""
    return str(number) if number.bit_length() <= 64 else f"a {number.bit_length()}-bit number"


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
