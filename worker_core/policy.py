"""The policy registry: the contract's defaults are set once for the whole deployment, and every override
carries a short reason.

Layers, most specific last (the last one that sets a value wins):

1. ``default``: built-in values, then the deployment's ``[defaults]`` (a ``qconsole.toml``, or
   ``[tool.qconsole.defaults]`` in ``pyproject.toml``, or the file ``$QCONSOLE_POLICY_FILE``), then
   environment variables ``QCONSOLE_<FIELD>`` (``QCONSOLE_MAX_ATTEMPTS=8``);
2. ``queue:<name>``: ``[queues.<name>]`` in that file, with a ``reason``;
3. ``type:<job_type>``: the ``@task(...)`` of the type, with ``reason=...``.

An override without a reason is refused with a clear error where it is declared.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker_core.envelope import DEFAULT_VISIBILITY_MARGIN_SECONDS, TypeDefaults
from worker_core.retry import BUILTIN as RETRY_BUILTIN
from worker_core.retry import FIELDS as RETRY_FIELDS
from worker_core.retry import RetryPolicy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FIELDS = ("max_attempts", "timeout_seconds", "visibility_timeout_seconds", *RETRY_FIELDS)
BUILTIN: dict[str, Any] = {
    "max_attempts": 5,
    "timeout_seconds": 60.0,
    "visibility_timeout_seconds": None,  # timeout + DEFAULT_VISIBILITY_MARGIN_SECONDS
    **RETRY_BUILTIN,
}
_TYPES: dict[str, type] = {"max_attempts": int, "backoff": str}


class PolicyError(ValueError):
    """A policy file or override breaks the rules (unknown field, bad value, no reason)."""


_DIGITS_RE = re.compile(r"[0-9]+")
_WHAT = {int: "an integer", float: "a number", str: "a string"}


def _coerce(name: str, value: Any, where: str) -> Any:
    """A policy field's value as its type, from a file's value or an environment variable's text. A value of
    another type is refused, never converted: ``int(2.9)`` made a budget of 2 attempts, ``int(True)`` one."""
    kind = _TYPES.get(name, float)
    text = value.strip() if isinstance(value, str) else None
    try:
        if isinstance(value, bool):  # a bool is an int to Python, not to a policy
            raise TypeError
        if kind is int and not isinstance(value, int) and not (text is not None and _DIGITS_RE.fullmatch(text)):
            raise TypeError
        if kind is str and text is None:
            raise TypeError
        return kind(value)
    except (TypeError, ValueError):
        raise PolicyError(f"{where}: {name} must be {_WHAT[kind]}, not {value!r}") from None


@dataclass(frozen=True)
class Layer:
    name: str
    values: dict[str, Any]
    reason: str | None = None


@dataclass(frozen=True)
class DeploymentPolicy:
    defaults: Layer
    queues: dict[str, Layer] = field(default_factory=dict)
    source: str = "built-in"

    def layers(self, queue: str, type_layer: Layer | None = None) -> list[Layer]:
        out = [self.defaults]
        if queue in self.queues:
            out.append(self.queues[queue])
        if type_layer is not None:
            out.append(type_layer)
        return out

    def effective(self, queue: str, type_layer: Layer | None = None) -> dict[str, tuple[Any, str]]:
        """Every field of the contract for a type in a queue: ``{field: (value, source)}``."""
        out: dict[str, tuple[Any, str]] = {}
        for layer in self.layers(queue, type_layer):
            for name, value in layer.values.items():
                out[name] = (value, layer.name)
        if out["visibility_timeout_seconds"][0] is None:
            out["visibility_timeout_seconds"] = (
                out["timeout_seconds"][0] + DEFAULT_VISIBILITY_MARGIN_SECONDS,
                out["timeout_seconds"][1],
            )
        return out

    def type_defaults(
        self, queue: str, type_layer: Layer | None = None, requires_idempotency_key: bool = False
    ) -> TypeDefaults:
        eff = {k: v for k, (v, _) in self.effective(queue, type_layer).items()}
        return TypeDefaults(
            queue=queue,
            max_attempts=eff["max_attempts"],
            timeout_seconds=eff["timeout_seconds"],
            visibility_timeout_seconds=eff["visibility_timeout_seconds"],
            retry_policy=RetryPolicy(**{k: eff[k] for k in RETRY_FIELDS}),
            requires_idempotency_key=requires_idempotency_key,
        )


def _shown(value: Any) -> str:
    """A TOML value as an error names it: ``[[defaults]]`` reads as a list of tables, which its repr hides."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return f"an array of tables {value!r}"
    return repr(value)


def _table(value: Any, source: str, key: str, expected: str) -> Mapping[str, Any]:
    """``value`` if it is a table, else a PolicyError naming the file, the key as the file writes it and what
    belongs there. ``defaults = 5``, ``queues.billing = 3`` or ``[[queues]]`` were a TypeError's or an
    AttributeError's traceback; ``defaults = "abc"`` was "unknown policy fields a, b, c", ``queues = 0`` no
    queues at all."""
    if not isinstance(value, Mapping):
        raise PolicyError(f"{source}: {key} must be a table ({expected}), not {_shown(value)}")
    return value


def _values(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(table) - set(FIELDS) - {"reason"})
    if unknown:
        raise PolicyError(f"{where}: unknown policy fields {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    if "reason" in table and not isinstance(table["reason"], str):  # reason = 5 was taken as the reason "5"
        raise PolicyError(f"{where}: reason must be a string, not {_shown(table['reason'])}")
    return {k: _coerce(k, v, where) for k, v in table.items() if k != "reason"}


def from_mapping(
    data: Mapping[str, Any], source: str, environ: Mapping[str, str] | None = None, *, tables: str = ""
) -> DeploymentPolicy:
    """The deployment's policy from a policy file's tables. ``tables``: where they sit in the file, as its
    errors name them (``tool.qconsole.`` in pyproject.toml: "[defaults]" named a table it does not have)."""
    data = _table(data, source, tables.rstrip(".") or "the file", f"[{tables}defaults] and [{tables}queues.<name>]")
    unknown = sorted(set(data) - {"defaults", "queues"})
    if unknown:
        raise PolicyError(
            f"{source}: unknown tables {', '.join(f'[{tables}{name}]' for name in unknown)} (expected"
            f" [{tables}defaults] and [{tables}queues.<name>])"
        )
    defaults = dict(BUILTIN)
    fields = f"policy fields: max_attempts = 5 under [{tables}defaults]"
    table = _table(data.get("defaults", {}), source, f"{tables}defaults", fields)
    defaults.update(_values(table, f"{source} [{tables}defaults]"))
    env = os.environ if environ is None else environ
    for name in FIELDS:
        raw = env.get(f"QCONSOLE_{name.upper()}")
        if raw is not None:
            defaults[name] = _coerce(name, raw, f"${'QCONSOLE_' + name.upper()}")
    queues = {}
    queue_tables = _table(data.get("queues", {}), source, f"{tables}queues", f"a [{tables}queues.<name>] per queue")
    for qname, value in queue_tables.items():
        where = f"{source} [{tables}queues.{qname}]"
        key = f"{tables}queues.{qname}"
        table = _table(value, source, key, f"policy fields and a reason under [{key}]")
        values = _values(table, where)
        reason = str(table.get("reason") or "").strip()
        if values and not reason:
            raise PolicyError(f"{where} overrides {', '.join(sorted(values))} without a reason: add reason = \"...\"")
        queues[qname] = Layer(f"queue:{qname}", values, reason)
    policy = DeploymentPolicy(Layer("default", defaults), queues, source)
    _check(policy)
    return policy


def _check(policy: DeploymentPolicy) -> None:
    """Every layer must still produce a valid contract (e.g. visibility above timeout + buffer)."""
    from worker_core.envelope import build_envelope

    for queue in ["default", *policy.queues]:
        try:
            build_envelope("policy.check", {}, {}, policy.type_defaults(queue))
        except ValueError as e:
            raise PolicyError(f"{policy.source}: the policy for queue {queue!r} is not a valid contract: {e}") from e


def find_policy_file(cwd: Path | None = None) -> tuple[Path | None, str]:
    """``$QCONSOLE_POLICY_FILE``, else ``./qconsole.toml``, else ``./pyproject.toml`` if it has [tool.qconsole]."""
    explicit = os.environ.get("QCONSOLE_POLICY_FILE")
    if explicit:
        return Path(explicit), "file"
    base = cwd or Path.cwd()
    if (base / "qconsole.toml").is_file():
        return base / "qconsole.toml", "file"
    if (base / "pyproject.toml").is_file() and _has_qconsole_tables(base / "pyproject.toml"):
        return base / "pyproject.toml", "pyproject"
    return None, "none"


def _has_qconsole_tables(pyproject: Path) -> bool:
    """A project's pyproject.toml without [tool.qconsole] is no policy file: taken for one, it made a producer
    run from the project's root (a web app) enqueue under the built-in defaults, not the workers' registered
    policy. One that does not read is taken, for load to say why."""
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return True
    tool = data.get("tool", {})
    return not isinstance(tool, Mapping) or "qconsole" in tool  # a [tool] that is no table: load says so


def load(path: Path | None = None, environ: Mapping[str, str] | None = None) -> DeploymentPolicy:
    kind = "file"
    if path is None:
        path, kind = find_policy_file()
    if path is None:
        return from_mapping({}, "built-in", environ)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise PolicyError(f"cannot read the policy file {path}: {e}") from e
    if kind == "pyproject" or path.name == "pyproject.toml":
        expected = "[tool.qconsole.defaults] and [tool.qconsole.queues.<name>]"
        tool = _table(data.get("tool", {}), str(path), "tool", expected)
        return from_mapping(tool.get("qconsole", {}), str(path), environ, tables="tool.qconsole.")
    return from_mapping(data, str(path), environ)


_current: DeploymentPolicy | None = None


def current() -> DeploymentPolicy:
    """The deployment's policy, loaded once per process."""
    global _current
    if _current is None:
        _current = load()
    return _current


def set_current(policy: DeploymentPolicy | None) -> None:
    """Replace (or, with None, forget) the process's policy: for tests and embedders."""
    global _current
    _current = policy
