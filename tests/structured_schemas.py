"""JSON schemas of the kinds clients send: the table the structured-output tests run."""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
    },
    "required": ["name", "age"],
}

SCHEMAS: dict[str, dict] = {
    "flat_required": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "count": {"type": "integer"},
            "done": {"type": "boolean"},
        },
        "required": ["title", "count", "done"],
    },
    "optional_fields": PERSON,
    "nested_object": {
        "type": "object",
        "properties": {
            "user": PERSON,
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"],
            },
        },
        "required": ["user", "address"],
    },
    "int_array_bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "object_array": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "label": {"type": "string"}},
                    "required": ["id", "label"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
    "string_enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "mixed_enum": {"enum": ["auto", 1, 2.5, None, True]},
    "int_bounds": {"type": "integer", "minimum": 10, "maximum": 9999},
    "int_exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
    "number_bounds": {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
        },
        "required": ["lat", "lon"],
    },
    "any_of_scalars": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "integer"}]},
    "any_of_objects": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                "required": ["kind", "r"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": {"type": "integer"}},
                "required": ["kind", "side"],
            },
        ]
    },
    "string_pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
        "required": ["code"],
    },
    "string_length": {"type": "string", "minLength": 3, "maxLength": 6},
    "null_only": {"type": "null"},
    "nullable": {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"]}, "n": {"type": ["integer", "null"]}},
        "required": ["note", "n"],
    },
    "boolean": {"type": "boolean"},
    "const_and_flags": {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 5},
        },
        "required": ["version", "flags"],
        "additionalProperties": False,
    },
    "defs_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "matrix": {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "number"},
            "minItems": 2,
            "maxItems": 2,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "deep_nesting": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "array", "items": {"type": "string"}}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "pydantic_style": {
        "title": "Invoice",
        "type": "object",
        "description": "An invoice as a Pydantic model exports it",
        "properties": {
            "number": {"title": "Number", "type": "string"},
            "total": {"title": "Total", "type": "number", "minimum": 0},
            "paid": {"title": "Paid", "default": False, "type": "boolean"},
            "status": {"title": "Status", "enum": ["draft", "sent", "void"], "type": "string"},
        },
        "required": ["number", "total", "status"],
    },
    "json_object_mode": {"type": "object"},
}
