"""The exception hierarchy: every rejection of bad input is a TPPError subclass.

Messages say what was expected and what was given, so the caller can fix the call
without reading the library's source.
"""


class TPPError(Exception):
    """Base class of every error the library raises on purpose."""


class SpecError(TPPError, ValueError):
    """A primitive description is invalid (unknown op, negative size, ld < n, ...)."""


class ArgumentError(TPPError, ValueError):
    """A call received arrays that do not match the primitive's spec."""


class UnsupportedError(TPPError, NotImplementedError):
    """A valid request that this backend or host cannot serve (dtype, ISA, device)."""


class CompileError(TPPError, RuntimeError):
    """The JIT failed to build a kernel; this is a library bug, please report it."""
