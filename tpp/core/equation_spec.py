"""The spec of a compiled equation (the `tpp.runtime.equations` builder makes it): its operands,
its cache key, the canonical text of its graph and its exact reference semantics."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from . import dtypes as _dt
from . import expr as X
from .errors import ArgumentError
from .optable import OpInfo
from .spec import Operand, mask_bytes

_INFO = OpInfo("equation", "equation", "equation", doc="a compiled tpp.equation")
MAX_STAGE_ELEMENTS = 1 << 16   # an axis-0 reduction keeps n (an axis-1 one m) f32 on the stack


def graph_text(outputs) -> str:
    """A canonical text of the graph behind the outputs (stable across processes)."""
    order = X.topological(outputs)
    index = {nd: k for k, nd in enumerate(order)}
    parts = []
    for nd in order:
        attr = ",".join(a.hex() if isinstance(a, bytes) else repr(a) for a in nd.attr)
        args = ",".join(str(index[a]) for a in nd.args)
        parts.append(f"{nd.op}[{args}]({attr}){nd.kind[0]}{nd.shape[0]}")
    parts.append("->" + ",".join(str(index[o]) for o in outputs))
    return ";".join(parts)


@dataclass(frozen=True)
class EquationSpec:
    m: int
    n: int
    inputs: tuple        # (name, layout, dtype, ld) per input: block/row/col/scalar/mask
    params: tuple        # names of the runtime f32 scalars
    outputs: tuple       # (name, layout, dtype, ld) per output: block/col/vector/scalar/mask
    graph: str           # graph_text of the output nodes
    uses_seed: bool
    stream: bool = False  # write big block outputs with non-temporal stores (see compile)
    nodes: tuple = field(compare=False, repr=False, default=())
    family = "equation"
    op = "equation"
    kind = "equation"
    info = _INFO
    params_items = ()

    def key(self) -> str:
        ins = ";".join(f"{n}:{lay}:{dt}:{ld}" for n, lay, dt, ld in self.inputs)
        outs = ";".join(f"{n}:{lay}:{dt}:{ld}" for n, lay, dt, ld in self.outputs)
        return (f"equation(m={self.m},n={self.n},inputs={ins},params={','.join(self.params)},"
                f"outputs={outs},stream={self.stream},graph={self.graph})")

    @property
    def scalars(self) -> tuple:
        return ("seed",) if self.uses_seed else ()

    def operands(self) -> tuple:
        m, n = self.m, self.n
        ops = []
        for name, layout, dt, ld in self.inputs:
            if layout == "block":
                ops.append(Operand(name, "in", "block", dt, m, n, ld, f"ld:{name}"))
            elif layout == "mask":
                ops.append(Operand(name, "in", "mask", _dt.U8, m, mask_bytes(n)))
            elif layout == "row":
                ops.append(Operand(name, "in", "row", dt, 1, n))
            elif layout == "col":
                ops.append(Operand(name, "in", "col", dt, m, 1))
            else:
                ops.append(Operand(name, "in", "scalar", dt, 1, 1))
        for name in self.params:
            ops.append(Operand(name, "in", "scalar", _dt.F32, 1, 1))
        for name, layout, dt, ld in self.outputs:
            if layout == "block":
                ops.append(Operand(name, "out", "block", dt, m, n, ld, f"ld:{name}"))
            elif layout == "mask":
                ops.append(Operand(name, "out", "mask", _dt.U8, m, mask_bytes(n)))
            elif layout == "col":
                ops.append(Operand(name, "out", "col", dt, m, 1))
            elif layout == "vector":
                ops.append(Operand(name, "out", "vector", dt, 1, n))
            else:
                ops.append(Operand(name, "out", "vector", dt, 1, 1))
        return tuple(ops)

    def replace(self, **changes):
        """The spec with other lds: keywords "ld:<operand name>" (what Kernel passes)."""
        lds = {k[3:]: v for k, v in changes.items() if k.startswith("ld:")}
        rest = {k: v for k, v in changes.items() if not k.startswith("ld:")}
        ins = tuple((nm, lay, dt, lds.get(nm, ld)) for nm, lay, dt, ld in self.inputs)
        outs = tuple((nm, lay, dt, lds.get(nm, ld)) for nm, lay, dt, ld in self.outputs)
        return dataclasses.replace(self, inputs=ins, outputs=outs, **rest)

    def __post_init__(self):
        for op in self.operands():
            op.check_addressable()

    # ------------------------------------------------------------ reference
    def reference(self, *arrays, seed=None):
        """The outputs computed exactly (float64, tpp.core.expr_eval) from the operands' arrays
        (inputs, then params, in operands() order), each rounded once to f32 and then to its
        dtype; one array, or a tuple in output order."""
        from . import expr_eval, reference
        ins = [o for o in self.operands() if o.role == "in"]
        if len(arrays) != len(ins):
            raise ArgumentError(f"the equation takes {len(ins)} inputs "
                                f"({', '.join(o.name for o in ins)}), got {len(arrays)}")
        inputs, params, masks = {}, {}, {}
        for op, arr in zip(ins, arrays):
            if op.name in self.params:
                params[op.name] = float(np.asarray(arr, np.float64).reshape(()))
            elif op.layout == "mask":
                masks[op.name] = reference.unpack_mask(arr, self.n)
            else:
                inputs[op.name] = np.asarray(arr).astype(np.float64)
        values = expr_eval.evaluate(self.nodes, self.m, self.n, inputs=inputs, params=params,
                                    masks=masks, seed=seed)
        results = []
        for (name, layout, dt, _), value in zip(self.outputs, values):
            if layout == "mask":
                results.append(reference.pack_mask(np.asarray(value, bool)))
                continue
            with np.errstate(all="ignore"):
                v = np.asarray(value, np.float64).astype(np.float32).astype(dt.numpy)
            results.append(v.reshape(-1) if layout != "block" else np.ascontiguousarray(v))
        return results[0] if len(results) == 1 else tuple(results)
