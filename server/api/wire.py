"""Number and boolean types for request schemas that accept exactly what their JSON Schema says.

pydantic's lax mode turns "5" and true into 5 (the schema says integer: both are refused by
JSON Schema), and its strict mode refuses 5.0 (an integer to JSON Schema). These types take the
JSON Schema view: integers may be written 5 or 5.0, never "5" or true; booleans are true/false.

    count: Int(ge=1, le=8) = 1        seed: Int() | None = None        stream: Bool = False
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, Strict


def _number(value: Any) -> Any:
    if isinstance(value, str | bool):
        raise ValueError("Input should be a number")  # noqa: TRY004 (pydantic reports ValueErrors)
    return value


def Int(**constraints: Any) -> Any:
    return Annotated[int, Field(**constraints), BeforeValidator(_number)]  # this order: JSON Schema bounds


def Float(**constraints: Any) -> Any:
    return Annotated[float, Field(**constraints), BeforeValidator(_number)]


Bool = Annotated[bool, Strict()]
