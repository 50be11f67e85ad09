"""Number and boolean types for request schemas that accept exactly what their JSON Schema says.

pydantic's lax mode turns "5" and true into 5 (the schema says integer: both are refused by
JSON Schema), and its strict mode refuses 5.0 (an integer to JSON Schema). These types take the
JSON Schema view: integers may be written 5 or 5.0, never "5" or true; booleans are true/false.

    count: Annotated[int, Field(ge=1, le=8), Number] = 1    seed: Annotated[int, Number] | None = None
    ratio: Annotated[float, Field(gt=0.0), Number] = 1.0   stream: Bool = False

The bounds (Field) come before Number: in that order they reach the JSON Schema.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Strict
from pydantic_core import PydanticCustomError


def _number(value: Any) -> Any:
    if isinstance(value, str | bool):  # a type error, as pydantic's own (server.api.errors tells them apart)
        raise PydanticCustomError("number_type", "Input should be a number")
    return value


Number = BeforeValidator(_number)
Bool = Annotated[bool, Strict()]
