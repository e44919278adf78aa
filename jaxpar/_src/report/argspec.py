"""Argument shapes on the command line: ``f32[8,16],{w1:f32[16,32],w2:f32[32]},(i32[8],)``.

Grammar (whitespace is ignored)::

    spec   := value ("," value)*               one value per positional argument
    value  := array | tuple | list | dict
    array  := DTYPE "[" [int ("," int)*] "]"   f32[8,16]; f32[] is a scalar
    tuple  := "(" [value ("," value)* [","]] ")"
    list   := "[" [value ("," value)*] "]"
    dict   := "{" key ":" value ("," key ":" value)* "}"    key: a name or a quoted string

``DTYPE`` is a short name (``f32``, ``bf16``, ``i32``, ``u8``, ``bool``, ...) or a NumPy one
(``float32``).  Arrays become ``jax.ShapeDtypeStruct``: planning needs shapes, not data.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

import jax
import jax.numpy as jnp

from jaxpar._src.errors import PlanError

SHORT_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
                "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8",
                "u16": "uint16", "u32": "uint32", "u64": "uint64", "bool": "bool",
                "pred": "bool", "c64": "complex64", "c128": "complex128"}
_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][\w.]*)|(?P<int>\d+)|(?P<str>'[^']*'|\"[^\"]*\")"
                    r"|(?P<punct>[\[\](){},:]))")


def parse_args_spec(text: str) -> tuple[Any, ...]:
    """The positional arguments that ``text`` describes.

    >>> x, p = parse_args_spec("f32[8,16], {w: bf16[16,4], b: f32[4]}")
    >>> x.shape, str(p["w"].dtype)
    ((8, 16), 'bfloat16')
    >>> parse_args_spec("(i32[],)")[0][0].shape
    ()
    """
    parser = _Parser(text)
    values = [parser.value()]
    while parser.peek() == ",":
        parser.take(",")
        values.append(parser.value())
    if parser.peek() is not None:
        parser.fail(f"unexpected {parser.peek()!r}")
    return tuple(values)


def dtype_of(name: str) -> Any:
    """A dtype from a short (``f32``) or NumPy (``float32``) name."""
    full = SHORT_DTYPES.get(name, name)
    try:
        return jnp.dtype(full)
    except TypeError:
        raise PlanError(f"jaxpar plan --args: unknown dtype {name!r}; use one of "
                        f"{', '.join(SHORT_DTYPES)} or a NumPy name such as float32.") from None


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                self.pos = pos
                self.fail(f"cannot read {text[pos:].strip()[:12]!r}")
            kind = m.lastgroup or "punct"
            self.tokens.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()
        self.i = 0

    def peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def take(self, want: str | None = None, kind: str | None = None) -> str:
        if self.i >= len(self.tokens):
            self.fail(f"the text ends where {want or kind} was expected")
        k, value, _ = self.tokens[self.i]
        if (want is not None and value != want) or (kind is not None and k != kind):
            self.fail(f"expected {want or kind}, found {value!r}")
        self.i += 1
        return value

    def fail(self, why: str) -> NoReturn:
        at = self.tokens[self.i][2] if self.i < len(self.tokens) else len(self.text)
        raise PlanError(
            f"jaxpar plan --args: {why} at position {at} of {self.text!r}. Write one value per "
            f"argument, e.g. 'f32[8,16],f32[16,32]'; pytrees as (..), [..] or {{name: ..}}.")

    def value(self) -> Any:
        tok = self.peek()
        if tok == "(":
            items = self.items("(", ")")
            return tuple(items)
        if tok == "[":
            return list(self.items("[", "]"))
        if tok == "{":
            return self.mapping()
        if tok is not None and self.tokens[self.i][0] == "name":
            return self.array()
        self.fail(f"expected an array such as f32[8,16], found {tok!r}")
        raise AssertionError  # unreachable: fail raises

    def items(self, open_: str, close: str) -> list[Any]:
        self.take(open_)
        out = []
        while self.peek() != close:
            out.append(self.value())
            if self.peek() == ",":
                self.take(",")
            elif self.peek() != close:
                self.fail(f"expected ',' or {close!r}")
        self.take(close)
        return out

    def mapping(self) -> dict[str, Any]:
        self.take("{")
        out: dict[str, Any] = {}
        while self.peek() != "}":
            kind = self.tokens[self.i][0] if self.i < len(self.tokens) else ""
            key = self.take()
            if kind == "str":
                key = key[1:-1]
            elif kind not in ("name", "int"):
                self.i -= 1
                self.fail("expected a key")
            self.take(":")
            out[key] = self.value()
            if self.peek() == ",":
                self.take(",")
            elif self.peek() != "}":
                self.fail("expected ',' or '}'")
        self.take("}")
        return out

    def array(self) -> jax.ShapeDtypeStruct:
        dtype = dtype_of(self.take(kind="name"))
        self.take("[")
        dims = []
        while self.peek() != "]":
            dims.append(int(self.take(kind="int")))
            if self.peek() == ",":
                self.take(",")
            elif self.peek() != "]":
                self.fail("expected ',' or ']' in a shape")
        self.take("]")
        return jax.ShapeDtypeStruct(tuple(dims), dtype)
