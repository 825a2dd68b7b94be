"""The request models' number rule: types are strict (a boolean is not a number, a numeric string is not
a number), but an integer field takes a float with an integral value (``100.0``), as JSON Schema counts
it an integer and as clients that compute a value send it."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel


def _is_integer_field(annotation: Any) -> bool:
    if annotation is int:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return int in args and float not in args
    return False


def integral_floats_as_ints(model: type[BaseModel], data: Any) -> Any:
    """``data`` with each top-level integer field's integral float turned into an int (a model's
    ``mode="before"`` validator)."""
    if not isinstance(data, dict):
        return data
    changed = None
    for name, field in model.model_fields.items():
        value = data.get(name)
        if isinstance(value, float) and value.is_integer() and _is_integer_field(field.annotation):
            changed = changed if changed is not None else dict(data)
            changed[name] = int(value)
    return changed if changed is not None else data
