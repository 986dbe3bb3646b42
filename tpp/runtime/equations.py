"""Equations: a graph of element-wise ops and reductions over one (m, n) block, compiled into
one kernel whose intermediates never leave registers.

    eq = tpp.equation(m, n)
    x, g, b = eq.input("x"), eq.input("g", bcast="row"), eq.input("b", bcast="row")
    mu = eq.mean(x, axis=1)                     # a column of m values, broadcast when used
    xc = x - mu
    y = xc * eq.rsqrt(eq.mean(xc * xc, axis=1) + eq.param("eps")) * g + b
    ln = eq.compile(y, mu=mu)                   # outputs: "out" (positional), "mu"
    res = ln(x=x_block, g=gamma, b=beta, eps=1e-5)
    res.out, res.mu                             # a named tuple; one output: the array itself

The values of an equation are `tpp.core.expr` nodes: combine them with + - * / and the methods of
`Equation` (math, comparisons, reductions, `op(name, ...)` for any element-wise TPP of the op
table). Inputs have a dtype (f32, bf16, f16; widened exactly to f32) and a broadcast (None: an
(m, n) block with any row stride; "row": n values; "col": m values; "scalar": one value);
`mask(name)` is a bitmask input (the library's layout, tpp.core.spec) read as a predicate;
`param(name)` a runtime f32 scalar (a Python number at the call). Reductions (`sum`, `mean`,
`max`, `min`) along axis 1 give a column of m values, along axis 0 a row of n values.

Outputs are named: positional ones "out", "out1", ...; keywords by their name. Each is stored
in the output's dtype (`dtypes={"out": "bf16"}`; default: the dtype shared by the block inputs,
else f32; reductions' results default to f32) with the shape of its node: (m, n), (m,) for a
column, (n,) for a row, (1,) for a scalar; a predicate is stored as a bitmask.

Semantics: f32 arithmetic node by node (tpp.core.expr); reductions sum in f32 in an unspecified
order; transcendentals as stated in tpp.core.mathlib. `tpp.core.reference.run(spec, ...)` evaluates the
same graph exactly in float64 (tpp.core.expr_eval) and rounds each output once. A compiled equation
is a TPP like the others: cached by its spec (the graph's canonical text is part of the key),
`dump()`-able, and callable inside loop nests (`nest.call(kernel, *addresses)`, operands in
`spec.operands()` order: inputs, params (as one-value tensors), outputs).
"""
from __future__ import annotations

import collections

import numpy as np

from ..core import checks
from ..core import dtypes as _dt
from ..core import expr as X
from ..core.equation_spec import EquationSpec, graph_text
from ..core.errors import ArgumentError, SpecError
from . import recording as _recording
from .kernel import Kernel

_BCAST_SHAPE = {None: "block", "row": "row", "col": "col", "scalar": "scalar"}


class Equation:
    """The builder of one equation over an (m, n) block (see the module docstring)."""

    def __init__(self, m, n):
        self.m = checks.integer(m, "m", minimum=1)
        self.n = checks.integer(n, "n", minimum=1)
        self._inputs: dict = {}      # name -> (node, layout, dtype)
        self._params: dict = {}      # name -> node

    # ------------------------------------------------------------ leaves
    def _new_name(self, name):
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecError(f"equation names are identifiers, got {name!r}")
        if name in self._inputs or name in self._params or name == "seed":
            raise SpecError(f"{name!r} is already a name in this equation")
        return name

    def input(self, name: str, *, dtype="f32", bcast=None) -> X.Node:
        """An input of the given dtype; bcast None (a block), "row", "col" or "scalar"."""
        self._new_name(name)
        if bcast not in _BCAST_SHAPE:
            raise SpecError(f"bcast must be one of None, 'row', 'col', 'scalar', got {bcast!r}")
        dt = _dt.float_dtype(dtype, f"dtype of {name!r}")
        shape = _BCAST_SHAPE[bcast]
        nd = X.input(name, shape)
        self._inputs[name] = (nd, "block" if bcast is None else bcast, dt)
        return nd

    def mask(self, name: str) -> X.Node:
        """A bitmask input of the block (tpp.core.spec's mask layout), as a predicate."""
        self._new_name(name)
        nd = X.maskbit(name)
        self._inputs[name] = (nd, "mask", _dt.U8)
        return nd

    def param(self, name: str) -> X.Node:
        """A runtime f32 scalar, given as a number (or one-value array) at each call."""
        self._new_name(name)
        nd = X.param(name)
        self._params[name] = nd
        return nd

    # ------------------------------------------------------------ reductions
    def sum(self, x, axis=1):
        return X.reduce("rsum", x, self._axis(axis))

    def mean(self, x, axis=1):
        axis = self._axis(axis)
        return X.reduce("rsum", x, axis) / X.extent(axis)

    def max(self, x, axis=1):
        return X.reduce("rmax", x, self._axis(axis))

    def min(self, x, axis=1):
        return X.reduce("rmin", x, self._axis(axis))

    @staticmethod
    def _axis(axis):
        if axis not in (0, 1) or isinstance(axis, bool):
            raise SpecError(f"axis must be 0 (over the rows) or 1 (over the columns), "
                            f"got {axis!r}")
        return axis

    # ------------------------------------------------------------ math
    @staticmethod
    def exp(x): return X.prim("exp", x)
    @staticmethod
    def log(x): return X.prim("log", x)
    @staticmethod
    def tanh(x): return X.prim("tanh", x)
    @staticmethod
    def sigmoid(x): return X.prim("sigmoid", x)
    @staticmethod
    def erf(x): return X.prim("erf", x)
    @staticmethod
    def sqrt(x): return X.sqrt(x)
    @staticmethod
    def rsqrt(x): return 1.0 / X.sqrt(x)
    @staticmethod
    def abs(x): return X.fabs(x)
    @staticmethod
    def maximum(a, b): return X.maximum(a, b)
    @staticmethod
    def minimum(a, b): return X.minimum(a, b)
    @staticmethod
    def fma(a, b, c): return X.fma(a, b, c)
    @staticmethod
    def where(cond, a, b): return X.select(cond, a, b)

    @staticmethod
    def gelu(x, approximate="none"):
        if approximate not in ("none", "tanh"):
            raise SpecError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        return X.prim("gelu" if approximate == "none" else "gelu_tanh", x)

    @staticmethod
    def relu(x):
        return X.select(x <= 0.0, 0.0, x)

    def op(self, name: str, *args, **params):
        """The element-wise TPP `name` of the op table applied to args (its single
        definition, tpp.core.optable); returns its output node (a tuple when it has several)."""
        from ..core import optable
        for family in ("unary", "binary"):
            table = optable.UNARY_OPS if family == "unary" else optable.BINARY_OPS
            if name in table:
                info = table[name]
                break
        else:
            raise SpecError(f"unknown element-wise op {name!r}")
        define = getattr(info, "expr", None)
        if define is None:
            raise SpecError(f"op {name!r} has no element-wise definition to use in an equation")
        p = dict(optable.check_params(info, params))
        return define(*args, p)

    # ------------------------------------------------------------ compile
    def spec(self, *outputs, dtypes=None, stream=False, **named) -> "EquationSpec":
        """The EquationSpec of these outputs (see compile)."""
        if not isinstance(stream, bool):
            raise SpecError(f"stream must be True or False, got {stream!r}")
        outs = [(("out" if k == 0 else f"out{k}"), nd) for k, nd in enumerate(outputs)]
        outs += list(named.items())
        if not outs:
            raise SpecError("an equation needs at least one output")
        dtypes = dict(dtypes or {})
        names = [name for name, _ in outs]
        unknown = set(dtypes) - set(names)
        if unknown:
            raise SpecError(f"dtypes= names no output: {sorted(unknown)}")
        for name, nd in outs:
            if not isinstance(nd, X.Node):
                raise SpecError(f"output {name!r} must be an expression node, got {nd!r}")
            if nd.kind == "i32":
                raise SpecError(f"output {name!r} is an integer expression; store f32 or "
                                f"a predicate")
            if name in self._inputs or name in self._params:
                raise SpecError(f"output name {name!r} is already an input's")
            if not name.isidentifier():
                raise SpecError(f"output names are identifiers, got {name!r}")
        nodes = [nd for _, nd in outs]
        used = {n.attr[0] for n in X.topological(nodes) if n.op in ("input", "maskbit", "param")}
        known = set(self._inputs) | set(self._params)
        foreign = used - known
        if foreign:
            raise SpecError(f"the outputs use {sorted(foreign)}, which are not inputs of this "
                            f"equation")
        for n in X.topological(nodes):
            if n.op == "input" and self._inputs[n.attr[0]][0] is not n:
                raise SpecError(f"input {n.attr[0]!r} is used with another broadcast than "
                                f"it was declared with")
        block_dts = {dt for _, layout, dt in self._inputs.values() if layout == "block"}
        default = block_dts.pop() if len(block_dts) == 1 else _dt.F32
        out_specs = []
        for name, nd in outs:
            if nd.kind == "bool":
                if nd.shape != "block":
                    raise SpecError(f"a predicate output ({name!r}) must vary over the block")
                if name in dtypes:
                    raise SpecError(f"output {name!r} is a bitmask; it takes no dtype")
                out_specs.append((name, "mask", _dt.U8, 0))
                continue
            layout = {"block": "block", "col": "col", "row": "vector", "scalar": "scalar"}[nd.shape]
            want = default if nd.shape == "block" else _dt.F32
            dt = _dt.float_dtype(dtypes.get(name, want), f"dtype of output {name!r}")
            out_specs.append((name, layout, dt, self.n if layout == "block" else 0))
        ins = tuple((name, layout, dt, self.n if layout == "block" else 0)
                    for name, (_, layout, dt) in self._inputs.items())
        uses_seed = any(n.op == "seed" for n in X.topological(nodes))
        return EquationSpec(self.m, self.n, ins, tuple(self._params), tuple(out_specs),
                            graph_text(nodes), uses_seed, stream, tuple(nodes))

    def compile(self, *outputs, dtypes=None, stream=False, **named) -> "EquationKernel":
        """The kernel computing the outputs (compiled on its first call, or by .compile()).
        stream=True writes the block outputs with non-temporal stores (where every output row
        is 16-byte aligned; a run-time check picks the ordinary stores otherwise): for a kernel
        called over many blocks whose outputs together exceed the caches, like a loop nest over
        a big tensor. By default only a kernel whose own outputs exceed them streams."""
        return equation_kernel(self.spec(*outputs, dtypes=dtypes, stream=stream, **named))



class EquationKernel(Kernel):
    """A compiled equation: call it with its inputs and params by name (or positionally in
    spec.operands() order), outputs given by name to write into existing arrays, seed= when
    the equation draws random bits. Returns the output array, or a named tuple of them."""

    def __init__(self, spec):
        super().__init__(spec)
        self._in_names = self.input_names
        self._params = set(spec.params)
        self._result = collections.namedtuple("EquationResult", self.output_names) \
            if len(self.output_names) > 1 else None

    def __call__(self, *args, seed=None, **named):
        if _recording.active:
            _recording.refuse(f"a {type(self).__name__} called outside a nest")
        names = self._in_names
        if len(args) > len(names):
            raise ArgumentError(f"the equation takes {len(names)} inputs ({', '.join(names)}), "
                                f"got {len(args)} positional arguments")
        given = dict(zip(names, args))
        outputs = {}
        for key, value in named.items():
            if key in self._in_names:
                if key in given:
                    raise ArgumentError(f"input {key!r} given twice")
                given[key] = value
            elif key in self.output_names:
                outputs[key] = value
            else:
                raise ArgumentError(f"the equation has no input or output named {key!r}; "
                                    f"inputs: {', '.join(names)}; outputs: "
                                    f"{', '.join(self.output_names)}")
        missing = [nm for nm in names if nm not in given]
        if missing:
            raise ArgumentError(f"missing input(s) {', '.join(missing)}")
        inputs = []
        for nm in names:
            value = given[nm]
            if nm in self._params:
                value = _scalar(value, nm)
            inputs.append(value)
        fast = self._fastcall       # one output, one or two inputs: Kernel's lean path
        if fast is not None and seed is None and len(outputs) <= ("out" in outputs):
            result = fast(tuple(inputs), outputs.get("out"))
            if result is not None:
                return result
        result = self._call_checked(tuple(inputs), outputs, seed)
        if self._result is not None:
            return self._result(*result)
        return result


def _scalar(value, name):
    if isinstance(value, bool):
        raise ArgumentError(f"{name} must be a number, got {value!r}")
    if isinstance(value, (int, float, np.floating, np.integer)):
        if _dt.overflows_f32(float(value)):
            raise ArgumentError(f"{name}={value!r} is beyond the f32 range of the equation's "
                                f"params (|{name}| < 3.4e38)")
        return np.full((), value, np.float32)
    return value


def equation_kernel(spec: EquationSpec) -> EquationKernel:
    """The kernel of an equation spec, one per spec per process (tpp.kernel's cache)."""
    import tpp
    return tpp.kernel(spec)
