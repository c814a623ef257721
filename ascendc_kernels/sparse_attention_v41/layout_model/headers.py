"""Read the kernel's constants from its C++ headers: the constexpr values, one-return constexpr functions, enums and
(templated) structs of ``op_kernel/*.h``, evaluated with C integer semantics.

Only the subset the headers use is understood: integer and float literals, names (``a::b`` too), the C operators
with their precedence (ternary included), calls of parsed functions, ``static_cast<T>(x)``. A definition is
evaluated when it is first asked for, so definitions that use device-only names (``EVENT_ID0``) never matter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

OP_KERNEL = Path(__file__).resolve().parent.parent / "op_kernel"

_TOKEN = re.compile(r"\s*(?:(0[xX][0-9a-fA-F]+|\d+\.\d*(?:[eE][-+]?\d+)?[fF]?|\d+(?:[eE][-+]?\d+)[fF]?|\d+)[uUlL]*"
                    r"|([A-Za-z_]\w*(?:::[A-Za-z_]\w*)*)|(<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%<>!~&|^?:(),]))")
_BINARY = {"||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, ">": 7, "<=": 7, ">=": 7,
           "<<": 8, ">>": 8, "+": 9, "-": 9, "*": 10, "/": 10, "%": 10}
_CAST_TYPES = ("uint8_t", "uint16_t", "uint32_t", "uint64_t", "int8_t", "int16_t", "int32_t", "int64_t", "bool",
               "float", "event_t", "KvFormat")
_BUILTINS = {"true": 1, "false": 0, "__builtin_inff": lambda: math.inf}


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ValueError(f"headers: cannot read {text[pos:pos + 40]!r}")
        out.append(m.group(m.lastindex))
        pos = m.end()
    return out


def _number(tok: str):
    if tok.lower().startswith("0x"):
        return int(tok, 16)
    if any(c in tok for c in ".eE") or tok.endswith(("f", "F")):
        return float(tok.rstrip("fF"))
    return int(tok)


def _c_div(a, b):
    if isinstance(a, float) or isinstance(b, float):
        return a / b
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _c_mod(a, b):
    return a - _c_div(a, b) * b


_APPLY = {"||": lambda a, b: int(bool(a) or bool(b)), "&&": lambda a, b: int(bool(a) and bool(b)),
          "|": lambda a, b: a | b, "^": lambda a, b: a ^ b, "&": lambda a, b: a & b,
          "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b), "<": lambda a, b: int(a < b),
          ">": lambda a, b: int(a > b), "<=": lambda a, b: int(a <= b), ">=": lambda a, b: int(a >= b),
          "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b, "+": lambda a, b: a + b, "-": lambda a, b: a - b,
          "*": lambda a, b: a * b, "/": _c_div, "%": _c_mod}


class _Expression:
    """A Pratt parser that evaluates as it parses, looking names up in ``lookup``."""

    def __init__(self, text: str, lookup: Callable[[str], object]):
        self.toks, self.i, self.lookup = _tokens(text), 0, lookup

    def value(self):
        v = self._ternary()
        if self.i != len(self.toks):
            raise ValueError(f"headers: unexpected {self.toks[self.i]!r} in {' '.join(self.toks)}")
        return v

    def _peek(self) -> Optional[str]:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def _take(self, expected: Optional[str] = None) -> str:
        tok = self._peek()
        if tok is None or (expected is not None and tok != expected):
            raise ValueError(f"headers: expected {expected!r}, got {tok!r} in {' '.join(self.toks)}")
        self.i += 1
        return tok

    def _ternary(self):
        cond = self._binary(1)
        if self._peek() != "?":
            return cond
        self._take("?")
        yes = self._ternary()
        self._take(":")
        no = self._ternary()
        return yes if cond else no

    def _binary(self, level: int):
        left = self._unary()
        while self._peek() in _BINARY and _BINARY[self._peek()] >= level:
            op = self._take()
            right = self._binary(_BINARY[op] + 1)
            left = _APPLY[op](left, right)
        return left

    def _unary(self):
        tok = self._peek()
        if tok in ("-", "+", "!", "~"):
            self._take()
            v = self._unary()
            return {"-": lambda: -v, "+": lambda: v, "!": lambda: int(not v), "~": lambda: ~v}[tok]()
        return self._primary()

    def _primary(self):
        tok = self._take()
        if tok == "(":
            v = self._ternary()
            self._take(")")
            return v
        if tok[0].isdigit():
            return _number(tok)
        if tok == "static_cast":
            self._take("<")
            cast = self._take()
            self._take(">")
            self._take("(")
            v = self._ternary()
            self._take(")")
            return int(v) if cast not in ("float", "bool") else (float(v) if cast == "float" else int(bool(v)))
        target = self.lookup(tok)
        if self._peek() == "(":
            self._take("(")
            args = []
            while self._peek() != ")":
                args.append(self._ternary())
                if self._peek() == ",":
                    self._take(",")
            self._take(")")
            return target(*args)
        return target


@dataclass
class Scope:
    """Lazily evaluated definitions; ``parent`` answers names this scope lacks."""

    exprs: dict = field(default_factory=dict)  # name -> expression text
    funcs: dict = field(default_factory=dict)  # name -> (parameter names, expression text)
    values: dict = field(default_factory=dict)  # name -> value (bindings, enums, evaluated expressions)
    parent: Optional["Scope"] = None

    def __getitem__(self, name: str):
        return self.lookup(name)

    def lookup(self, name: str):
        if name in self.values:
            return self.values[name]
        if name in self.exprs:
            self.values[name] = _Expression(self.exprs[name], self.lookup).value()
            return self.values[name]
        if name in self.funcs:
            return self._function(name)
        if name in _BUILTINS:
            return _BUILTINS[name]
        if self.parent is not None:
            return self.parent.lookup(name)
        raise KeyError(f"headers: {name!r} is not defined")

    def _function(self, name: str):
        params, body = self.funcs[name]

        def call(*args):
            local = Scope(values=dict(zip(params, args)), parent=self)
            return _Expression(body, local.lookup).value()
        return call


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_QUALIFIERS = r"(?:(?:static|inline|__aicore__)\s+)*constexpr\s+(?:inline\s+)?"
_VALUE = re.compile(_QUALIFIERS + r"[\w:]+\s+(\w+)\s*=\s*([^;{]+);")
_FUNC = re.compile(_QUALIFIERS + r"[\w:]+\s+(\w+)\s*\(([^)]*)\)\s*\{\s*return\s+([^;]+);\s*\}")
_ENUM = re.compile(r"enum\s+class\s+(\w+)\s*:\s*\w+\s*\{([^}]*)\};")
_STRUCT = re.compile(r"(?:template\s*<([^>]*)>\s*)?struct\s+(\w+)\s*\{")
_FIXPIPE_CONFIG = re.compile(r"constexpr\s+FixpipeConfig\s+(\w+)\s*(?:=\s*)?"
                             r"\{\s*CO2Layout::(\w+)\s*(?:,\s*(\w+))?\s*\}")


def _body(text: str, open_brace: int) -> tuple[str, int]:
    depth, i = 0, open_brace
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_brace + 1:i], i
        i += 1


def _fill(scope: Scope, text: str) -> None:
    for m in _FUNC.finditer(text):
        params = [p.split()[-1] for p in m.group(2).split(",") if p.strip()]
        scope.funcs[m.group(1)] = (params, m.group(3))
    for m in _VALUE.finditer(text):
        scope.exprs[m.group(1)] = m.group(2)


@dataclass
class Headers:
    """The parsed headers: ``headers["kHeadDim"]``, ``headers.struct("UbLayout", MAIN=2, EXTRA=3)["kRaw"]``."""

    scope: Scope
    structs: dict  # name -> (template parameter names, body text)
    fixpipe_configs: dict  # name -> (CO2Layout name, isToUB)

    def __getitem__(self, name: str):
        return self.scope.lookup(name)

    def struct(self, name: str, **template_args) -> Scope:
        params, body = self.structs[name]
        missing = set(params) - set(template_args)
        if missing:
            raise ValueError(f"struct {name}: template arguments {sorted(missing)} not given")
        inner = Scope(values=dict(template_args), parent=self.scope)
        _fill(inner, body)
        return inner


def parse(texts: list[str]) -> Headers:
    """Parse header texts (in include order)."""
    scope = Scope()
    structs, configs = {}, {}
    for raw in texts:
        text = _COMMENT.sub("", raw)
        for m in _ENUM.finditer(text):
            for i, item in enumerate(x for x in m.group(2).split(",") if x.strip()):
                key, _, val = item.partition("=")
                scope.exprs[f"{m.group(1)}::{key.strip()}"] = val.strip() or str(i)
        outside, pos = [], 0
        for m in _STRUCT.finditer(text):
            if m.start() < pos:
                continue
            body, end = _body(text, m.end() - 1)
            params = [p.split()[-1] for p in (m.group(1) or "").split(",") if p.strip()]
            structs[m.group(2)] = (params, body)
            outside.append(text[pos:m.start()])
            pos = end + 1
        outside.append(text[pos:])
        _fill(scope, "".join(outside))
        for m in _FIXPIPE_CONFIG.finditer(text):
            configs[m.group(1)] = (m.group(2), (m.group(3) or "false") == "true")
    return Headers(scope, structs, configs)


# The configs asc-devkit predefines for the 950 (kernel_struct_fixpipe.h, as documented): isToUB false for all.
DOCUMENTED_FIXPIPE_CONFIGS = {"CFG_NZ": ("NZ", False), "CFG_ROW_MAJOR": ("ROW_MAJOR", False),
                              "CFG_COLUMN_MAJOR": ("COLUMN_MAJOR", False)}
_FIXPIPE_CALL = re.compile(r"Fixpipe<\s*float\s*,\s*float\s*,\s*(\w+)\s*>")


def fixpipe_config(platform_text: str, headers: Headers) -> tuple[str, bool]:
    """(CO2Layout, isToUB) of the config the kernel's FixPipe to UB is instantiated with (in platform.h)."""
    names = set(_FIXPIPE_CALL.findall(_COMMENT.sub("", platform_text)))
    if len(names) != 1:
        raise ValueError(f"platform.h: expected one Fixpipe<float, float, CONFIG> call, found configs {names}")
    name = names.pop()
    known = {**DOCUMENTED_FIXPIPE_CONFIGS, **headers.fixpipe_configs}
    if name not in known:
        raise ValueError(f"platform.h: FixPipe config {name!r} is neither documented nor defined in the headers")
    return known[name]


KERNEL_HEADERS = ("tiling_data.h", "data_paths.h", "platform.h", "layout.h")


def kernel_headers(directory: Path = OP_KERNEL) -> Headers:
    """The kernel's headers as they are in ``directory``."""
    return parse([(directory / name).read_text() for name in KERNEL_HEADERS])
