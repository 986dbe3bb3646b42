"""The exception hierarchy: every rejection of bad input is a TPPError subclass.

Messages say what was expected and what was given, so the caller can fix the call
without reading the library's source.
"""


class TPPError(Exception):
    """Base class of every error the library raises on purpose."""


class SpecError(TPPError, ValueError):
    """A primitive description is invalid (unknown op, negative size, ld < n, ...)."""


class ArgumentError(TPPError, ValueError, RuntimeError):
    """A call received arrays that do not match the primitive's spec (or an operator's
    contract). Also a RuntimeError: torch raises RuntimeError for the same mistakes (shapes
    that do not match a weight, a normalized_shape, a channel count), so code written around
    a torch module catches the drop-in's errors as it caught torch's."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong kind (a list where a tensor goes): also a TypeError, as
    torch's and Python's errors for it are."""


class UnsupportedError(TPPError, NotImplementedError):
    """A valid request that this backend or host cannot serve (dtype, ISA, device)."""


class CompileError(TPPError, RuntimeError):
    """The JIT failed to build a kernel; this is a library bug, please report it."""
