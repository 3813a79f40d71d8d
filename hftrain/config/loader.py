"""Reading, overriding and saving the job config: YAML through a strict loader, command-line overrides, coercion.

Unknown keys and wrong types are errors that name the key and the closest valid one; so are an empty file, a key
given twice, and non-finite numbers. A list field takes ``--field a b`` or ``--field a,b`` on the command line.

The parallel axes and their options moved from ``strategy`` to the ``parallelism`` section: ``strategy.tp`` (and
every other :data:`MOVED_KEYS` entry) is still read, as ``parallelism.tp``, with one deprecation line per key and
process; a file that sets both names of one field is refused. Configs read back from a run or a checkpoint convert
silently (the user did not write them).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import stat
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from hftrain.config.schema import REMOVED_KEYS, RUN_INVARIANT_EXEMPT, ParallelismConfig, TrainConfig
from hftrain.errors import ConfigError
from hftrain.files import kind_of, read_input

CONFIG_FILENAME = "hftrain_config.yaml"
RUN_ID_KEY = "run_id"
"""The top-level key of a run's saved config that holds its id (``hftrain.checkpoint.run``); a job config that
carries one (a run's saved config reused as a job config) has it ignored: a run's id comes from its output_dir."""

MOVED_KEYS = {f"strategy.{f.name}": f"parallelism.{f.name}" for f in dataclasses.fields(ParallelismConfig)}
"""Old key -> new key: the parallel axes were megatron keys in ``strategy`` until the ``parallelism`` section."""
_warned: set[str] = set()


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Build a validated config from an optional YAML file and command-line overrides.

    Args:
        path: YAML file with sections ``model``, ``data``, ``training``, ``strategy``; None for defaults.
        overrides: ``["--learning_rate", "1e-4", "--training.seed=3", ...]``.
    """
    raw = _read_yaml(Path(path)) if path is not None else {}
    config = from_dict(raw, source=str(path) if path else "defaults")
    pairs = _parse_overrides(overrides or [])
    _check_one_name_each([key for key, _ in pairs])
    for key, values in pairs:
        set_field(config, key, _override_value(key, values), source="command line")
    return config.validate()


def _check_one_name_each(keys: list[str]) -> None:
    """Refuse a command line that sets one field by both its names (``--strategy.tp 2 --parallelism.tp 4``), as a
    file with both is refused: which one the user meant cannot be told, and the last one would win unsaid. One name
    given twice (``--max_steps 4 ... --max_steps 8``) stays an override: the last one wins, as a shell alias expects.

    Args:
        keys: the override keys as given (``strategy.tp``, ``tp``, ``training.seed``...).
    """
    seen: dict[str, tuple[str, bool]] = {}  # section.field -> (the key as given, given by its old name)
    for key in keys:
        section, name = _resolve_key(key, "command line", written=False)
        full, old = f"{section}.{name}", key in MOVED_KEYS
        if full in seen and seen[full][1] != old:
            raise ConfigError(f"command line: --{seen[full][0]} and --{key} are one field ({full}); keep --{full}")
        seen.setdefault(full, (key, old))


def from_dict(raw: dict[str, Any], *, source: str = "config", written: bool = True) -> TrainConfig:
    """Build a config from ``{section: {field: value}}``, rejecting unknown keys and wrong types.

    Args:
        raw: the sections.
        source: where they come from, for errors.
        written: a person wrote them (a job config), so an old key (:data:`MOVED_KEYS`) gets its deprecation
            line; False for a config read back from a run or a checkpoint.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections ({', '.join(_sections(TrainConfig))})")
    config = TrainConfig()
    seen: dict[str, str] = {}  # the key set -> as written
    for section, values in raw.items():
        if section == RUN_ID_KEY:
            continue
        if not isinstance(section, str):  # YAML reads `1:` as an int key
            raise ConfigError(f"{source}: section name {section!r} is not a name; use {', '.join(_sections(config))}")
        _check_key(section, _sections(TrainConfig), f"{source}: unknown section", "")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of fields")
        for key, value in values.items():
            if not isinstance(key, str):
                raise ConfigError(f"{source}: key {key!r} in section '{section}' is not a field name")
            given = f"{section}.{key}"
            if given in REMOVED_KEYS and not written and value is None:
                continue  # a run saved before the key went, at its default: nothing to carry over
            new = MOVED_KEYS.get(given, given)
            if new in seen:
                raise ConfigError(f"{source}: {seen[new]} and {given} are one field ({new}); keep {new}")
            seen[new] = given
            set_field(config, given, value, source=source, written=written)
    if not written:
        # Trust to run a model folder's code comes from the person's own command, never from a file hftrain wrote
        # (a checkpoint's or a run's saved config, which anyone who can write the folder can forge).
        config.model.trust_remote_code = False
    return config


def config_from_flat(flat: dict[str, Any], *, source: str) -> TrainConfig:
    """The config stored flat (``{"section.field": value}``, as checkpoints keep it)."""
    nested: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, name = key.split(".", 1)
        nested.setdefault(section, {})[name] = value
    return from_dict(nested, source=source, written=False)


def nest_fields(flat: dict[str, Any], *, source: str) -> dict[str, dict[str, Any]]:
    """``{section: {field: value}}`` from bare field names (``{"name": "megatron", "tp": 2}``), each put in the
    section that owns it, as a bare ``--tp`` on the command line is; an unknown name is a ``ConfigError`` naming the
    closest one.

    Args:
        flat: field name -> value.
        source: where the names come from, for errors.
    """
    nested: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, name = _resolve_key(key, source)
        nested.setdefault(section, {})[name] = value
    return nested


def set_field(config: TrainConfig, key: str, value: Any, *, source: str, written: bool = True) -> None:
    """Set ``section.field`` (or a unique bare ``field``) with type checking; an old key (:data:`MOVED_KEYS`) sets
    its new one, with a deprecation line when ``written``."""
    section, name = _resolve_key(key, source, written=written)
    target = getattr(config, section)
    hint = typing.get_type_hints(_SECTION_TYPES[section])[name]
    setattr(target, name, coerce(value, hint, f"{section}.{name}"))


def save_config(config: TrainConfig, directory: str | Path, *, run_id: str | None = None) -> Path:
    """Write the resolved config as YAML into ``directory``, atomically (a reader sees the old or the new file).

    Args:
        config: the resolved config.
        directory: the run's ``output_dir`` (it must exist).
        run_id: the run's id, written as the top-level ``run_id`` key.
    """
    import yaml

    from hftrain.files import write_file

    path = Path(directory) / CONFIG_FILENAME
    saved: dict[str, Any] = {RUN_ID_KEY: run_id} if run_id else {}
    # A new file renamed over the config: a link planted at its name (or at a fixed staging name) is replaced, never
    # written through (hftrain.files).
    write_file(path, yaml.safe_dump({**saved, **config.to_dict()}, sort_keys=False))
    return path


def config_differences(config: TrainConfig, other: TrainConfig) -> list[str]:
    """Keys whose values differ between two configs, ignoring run-invariant-exempt fields."""
    mine, theirs = config.flat(), other.flat()
    return sorted(k for k in mine if k not in RUN_INVARIANT_EXEMPT and mine[k] != theirs.get(k))


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a type hint, converting strings from YAML/CLI where unambiguous."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, typing.get_args(hint), key)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint_text = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{key}: '{value}' is not one of {', '.join(map(str, choices))}{hint_text}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(hint)
        return [coerce(v, item, key) for v in value]
    scalar = _SCALARS.get(hint)
    if scalar is None:
        raise TypeError(f"unsupported config type {hint} for {key}")
    return scalar(value, key)


def _coerce_union(value: Any, args: tuple[Any, ...], key: str) -> Any:
    if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
        if type(None) in args:
            return None
        raise ConfigError(f"{key}: may not be null")
    errors = []
    for arg in (a for a in args if a is not type(None)):
        try:
            return coerce(value, arg, key)
        except ConfigError as error:
            errors.append(error)
    raise errors[-1]


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")


def _to_float(value: Any, key: str) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):  # PyYAML reads '5e-5' (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(number):  # inf/nan train on NaN from the first step
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    return number


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _sections(config: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(config)]


def _field_owners() -> dict[str, str]:
    owners: dict[str, str] = {}
    for section in dataclasses.fields(TrainConfig):
        for f in dataclasses.fields(section.default_factory()):  # type: ignore[misc]
            owners[f.name] = section.name
    return owners


def _resolve_key(key: str, source: str, *, written: bool = True) -> tuple[str, str]:
    owners = _field_owners()
    if key in REMOVED_KEYS:
        raise ConfigError(f"{source}: {REMOVED_KEYS[key]}")
    if key in MOVED_KEYS:
        new = MOVED_KEYS[key]
        if written and key not in _warned:
            _warned.add(key)
            from hftrain.log import log_main

            log_main(
                f"{source}: {key} is deprecated and read as {new}: the parallel axes moved to the parallelism "
                f"section; write {new}"
            )
        key = new
    if "." in key:
        section, name = key.split(".", 1)
        _check_key(section, _sections(TrainConfig), f"{source}: unknown section", "")
        fields = [k for k, s in owners.items() if s == section]
        _check_key(name, fields, f"{source}: unknown key", f"{section}.")
        return section, name
    _check_key(key, list(owners), f"{source}: unknown key", "")
    return owners[key], key


def _check_key(key: str, valid: list[str], prefix: str, qualifier: str) -> None:
    if key in valid:
        return
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{qualifier}{close[0]}'?" if close else f"; valid: {', '.join(valid)}"
    raise ConfigError(f"{prefix} '{qualifier}{key}'{hint}")


def _parse_overrides(args: list[str]) -> list[tuple[str, list[str]]]:
    """``[(key, values)]`` from ``--key v``, ``--key=v`` and, for list fields, ``--key a b`` / ``--key a,b``."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"command line: expected '--key value' or '--key=value', got '{arg}'")
        i += 1
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            pairs.append((key, [value]))
            continue
        values = []
        while i < len(args) and not args[i].startswith("--"):  # '-1' is a value, '--seed' the next key
            values.append(args[i])
            i += 1
        if not values:
            raise ConfigError(f"command line: '{arg}' needs a value")
        pairs.append((arg[2:], values))
    return pairs


def _override_value(key: str, values: list[str]) -> Any:
    """One command-line value, or a list for a list field (``a b`` and ``a,b`` both; ``null`` for none)."""
    section, name = _resolve_key(key, "command line", written=False)  # set_field says it once
    hint = typing.get_type_hints(_SECTION_TYPES[section])[name]
    takes_list = any(typing.get_origin(arg) is list for arg in (hint, *typing.get_args(hint)))
    if takes_list and values != ["null"] and values != ["none"]:
        return [piece for value in values for piece in value.split(",") if piece]
    if len(values) != 1:
        raise ConfigError(
            f"command line: {section}.{name} takes one value, got {len(values)} ({' '.join(values)}); "
            "quote a value that contains spaces"
        )
    return values[0]


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        mode = path.stat().st_mode  # follows a link (/dev/fd/63 is one) without opening anything
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist; pass an existing YAML file to --config") from None
    except OSError as error:  # a link loop, a permission on a folder of the path
        raise ConfigError(
            f"config file '{path}' cannot be read ({error.strerror}); fix the path or its permissions"
        ) from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"--config '{path}' is a directory; pass the YAML file itself")
    if not stat.S_ISREG(mode):
        # --config <(...) or a FIFO: read once, yet a launched job's every process (and a resume) reads the config
        kind = "a pipe" if stat.S_ISFIFO(mode) else kind_of(mode)
        raise ConfigError(
            f"--config '{path}' is {kind}, not a regular file (every process of a launched job reads the config, and "
            "a pipe can be read only once); write the config to a file first (e.g. cat job.yaml > my_job.yaml) and "
            "give that file"
        )
    try:
        text = read_input(path, "--config").decode()
        raw = yaml.load(text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}' is not UTF-8 text; pass a YAML file") from None
    except OSError as error:
        raise ConfigError(f"config file '{path}' cannot be read ({error.strerror}); fix its permissions") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(error, "problem", None) or ""
        detail = f" ({problem})" if "duplicate" in problem else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{where}{detail}; fix its syntax") from None
    if raw is None:  # an empty file (or only comments) is almost always the wrong file
        raise ConfigError(f"config file '{path}' is empty; give at least one section, or drop --config for defaults")
    return raw


def _strict_loader() -> type:
    """A ``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key}'", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


_SECTION_TYPES = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}  # type: ignore[misc]
