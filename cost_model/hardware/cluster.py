"""Hardware profiles on disk and by name: a preset (cost_model.hardware.presets), a JSON profile
as written by `fxpar calibrate --out FILE`, or a `Cluster` (cost_model.hardware.spec) passed
through. The spec's names are re-exported here, where most code reads them."""

from __future__ import annotations

import json
import os

from cost_model.hardware.presets import PRESETS
from cost_model.hardware.spec import (CALIBRATE_HINT, PER_ELEMENT_RULES, RUNTIME_FIELDS, Cluster,
                                      ProfileError)

__all__ = [
    "Cluster",
    "PER_ELEMENT_RULES",
    "PRESETS",
    "ProfileError",
    "RUNTIME_FIELDS",
    "get_cluster",
    "load_profile",
    "save_profile",
]


def load_profile(path: str | os.PathLike) -> Cluster:
    """Read a JSON profile; every failure is a ProfileError naming the file."""
    path = os.fspath(path)
    hint = f"create it with `{CALIBRATE_HINT.replace('FILE', path)}` or use a preset"
    if not os.path.exists(path):
        raise ProfileError(
            f"cluster profile {path} does not exist; {hint} "
            f"({', '.join(sorted(PRESETS))})"
        )
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cluster profile {path} could not be read ({exc}); {hint}") from exc
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ProfileError(f"cluster profile {path} is not valid JSON ({exc}); {hint}") from exc
    return Cluster.from_json(data, source=path)


def _reject_constant(token: str) -> float:
    # Python's json accepts NaN/Infinity, which are not JSON and never valid here.
    raise ValueError(f"non-standard JSON constant {token}")


def save_profile(cluster: Cluster, path: str | os.PathLike) -> None:
    """Write `cluster` as JSON; written to a temp file first so that a crash
    never leaves a half-written profile behind."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(cluster.to_json(), fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def get_cluster(name_or_path: "str | os.PathLike | Cluster") -> Cluster:
    """A preset by name, a profile by path, or a Cluster passed through."""
    if isinstance(name_or_path, Cluster):
        return name_or_path
    if isinstance(name_or_path, os.PathLike):
        return load_profile(name_or_path)
    if not isinstance(name_or_path, str):
        raise TypeError(
            f"expected a preset name, a profile path or a Cluster, got {name_or_path!r}")
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    looks_like_path = (
        name_or_path.endswith(".json") or os.sep in name_or_path or os.path.exists(name_or_path)
    )
    if looks_like_path:
        return load_profile(name_or_path)
    raise ValueError(
        f"unknown cluster {name_or_path!r}; known presets: {', '.join(sorted(PRESETS))}; "
        f"or pass the path of a JSON profile (make one with `{CALIBRATE_HINT}`)"
    )
