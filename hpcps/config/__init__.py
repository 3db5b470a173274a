"""Typed training configuration: file < ``HPCPS_*`` environment < ``--set``.

Keys are dotted ``section.key`` (``optimizer.sparse.lr``); the environment
name of a key is ``HPCPS_`` + the key upper-cased with dots as underscores
(``HPCPS_OPTIMIZER_SPARSE_LR``), and ``HPCPS_NUM_PS``, ``HPCPS_MODE``,
``HPCPS_TRANSPORT`` set ``job.num_ps``, ``job.mode``, ``job.transport``.
Unknown keys and bad values raise ``ValueError`` naming the key and where it
came from.
"""

import difflib
import json
import os
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:                                    # pragma: no cover
    import tomli as tomllib

from .rules import SWITCHES, build_sparse_optimizer, deterministic, parse_permissions, resolve_switch, validate
from .schema import AUTO_EPOCHS, ENV_ALIASES, FORMATS, MODELS, Config, config_keys

__all__ = ["Config", "load_config", "config_keys", "build_sparse_optimizer", "deterministic", "parse_permissions", "resolve_switch",
           "validate", "SWITCHES", "ENV_ALIASES", "FORMATS", "MODELS"]


SAVED = "the checkpoint's config"          # the source of a base config (to_dict() keeps "auto" epochs as -1)

# keys naming data columns: a name, a 0-based number, or a list of them (data.categorical also "rest")
COLUMN_KEYS = ("data.label", "data.id", "data.categorical", "data.dense", "data.drop")


def _item(x: str):
    x = x.strip().strip("'\"")
    return int(x) if x.isdigit() else x


def _columns(key, value, where):
    if key in ("data.label", "data.id"):
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str):
            return value.strip()
        raise ValueError(f"{where}: expected a column name or a 0-based number")
    if isinstance(value, str):
        return [_item(x) for x in value.split(",")] if value.strip() else []
    if isinstance(value, list) and all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in value):
        return [x.strip() if isinstance(x, str) else x for x in value]
    raise ValueError(f"{where}: expected a list of column names or 0-based numbers")


def _coerce(key, value, default, source):
    """``value`` as the type of ``default``. Text is converted only where every value is text
    (environment, ``--set``): in a TOML file a number or list written as a string is an error,
    as is Python's ``1_000`` or a float where an integer belongs. Local."""
    kind = type(default)
    where = f"config: {key} = {value!r} ({source})"
    if key == "job.epochs" and isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO_EPOCHS
    if key == "job.epochs" and _negative(value) and not (source == SAVED and value == AUTO_EPOCHS):
        raise ValueError(f"{where}: must be >= 0 or \"auto\"")   # -1 is how "auto" is kept (a saved config's)
    from_text = not source.startswith("file ")
    if kind is dict:                    # a table: in a file as TOML, in text as JSON
        try:
            value = json.loads(value) if isinstance(value, str) and from_text else value
        except json.JSONDecodeError:
            raise ValueError(f"{where}: expected a JSON object, e.g. {{\"optimizer.wide.lr\": [0.1, 0.3]}}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a table of keys")
        return value
    if isinstance(value, str) and kind is not str and from_text:
        text = value.strip()
        try:
            if "_" in text and kind in (int, float):     # Python's 1_000, not a TOML or shell number
                raise ValueError
            if kind is bool:
                low = text.lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                return low in ("true", "1", "yes", "on")
            if kind is int:
                return int(text)
            if kind is float:
                return float(text)
            if kind is list:
                text = text.strip("[]")
                items = [_item(x) for x in text.replace(",", " ").split()] if text else []
                if key not in COLUMN_KEYS and not all(isinstance(x, int) for x in items):
                    raise ValueError(f"{where}: expected a list of integers, e.g. [512, 256]")
                return items
        except ValueError:
            need = "a list of integers, e.g. [512, 256]" if kind is list and key not in COLUMN_KEYS else kind.__name__
            raise ValueError(f"{where}: expected {need}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list and isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return list(value)
    if key in COLUMN_KEYS:
        return _columns(key, value, where)
    if kind is list and isinstance(value, list):         # layer sizes and the like: integers
        raise ValueError(f"{where}: expected a list of integers, e.g. [512, 256]")
    if kind is str and isinstance(value, bool):          # a switch written as a TOML boolean
        return "on" if value else "off"
    if type(value) is not kind:
        got = "a string" if isinstance(value, str) else type(value).__name__
        raise ValueError(f"{where}: expected {kind.__name__}, got {got}"
                         + (" (write it without quotes)" if isinstance(value, str) else ""))
    return value


TABLE_KEYS = ("tune.space",)             # a key whose value is a whole TOML table, kept as a dict


def _flatten(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in TABLE_KEYS:
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _set(cfg, key, value, source, keys):
    if key not in keys:
        near = difflib.get_close_matches(key, keys, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"config: unknown key {key!r} ({source}){hint}")
    *path, last = key.split(".")
    obj = cfg
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, last, _coerce(key, value, getattr(obj, last), source))


def _negative(value) -> bool:
    try:
        return int(str(value).strip()) < 0
    except ValueError:
        return False


LAUNCHER_ENV = ("HPCPS_JOB_NAME",)        # slurm/chain.sh's: a variable of a section's prefix, not a key


def _check_environment(env, keys) -> None:
    """An ``HPCPS_<SECTION>_...`` variable that names no key is an error with a suggestion, as an
    unknown ``--set`` key is (the launchers' own ``HPCPS_`` variables name no section, but for
    ``LAUNCHER_ENV``). Local."""
    names = {"HPCPS_" + k.upper().replace(".", "_"): k for k in keys}
    sections = {f"HPCPS_{k.split('.')[0].upper()}_" for k in keys}
    for name in env:
        if (name in names or name in ENV_ALIASES or name in LAUNCHER_ENV
                or not any(name.startswith(s) for s in sections)):
            continue
        near = difflib.get_close_matches(name, list(names), n=1)
        hint = f"; did you mean {near[0]!r} ({names[near[0]]})?" if near else ""
        raise ValueError(f"config: environment {name} names no config key{hint}")


def load_config(path=None, overrides=(), environ=None, base: dict | None = None) -> Config:
    """Merge defaults < ``base`` (a saved config's ``to_dict()``, e.g. a checkpoint's) < TOML file
    < environment < ``overrides`` ("key=value"), then validate. Local."""
    cfg = Config()
    keys = config_keys()
    for key, value in _flatten(base or {}):
        if key in keys:                      # a key of an older version's config is left out
            _set(cfg, key, value, SAVED, keys)
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ValueError(f"config: cannot read {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config: {path} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"config: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        for key, value in _flatten(data):
            _set(cfg, key, value, f"file {path}", keys)
    env = os.environ if environ is None else environ
    _check_environment(env, keys)
    for key in keys:
        name = "HPCPS_" + key.upper().replace(".", "_")
        if name in env:
            _set(cfg, key, env[name], f"environment {name}", keys)
    for name, key in ENV_ALIASES.items():
        if name in env:
            _set(cfg, key, env[name], f"environment {name}", keys)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"config: --set takes key=value, got {item!r}")
        key, value = item.split("=", 1)
        _set(cfg, key.strip(), value, "--set", keys)
    validate(cfg)
    return cfg
