"""Where data lives: `Device(kind, index)`, the value the runtime dispatches on.

    Device("cpu")            # the host (index 0); also tpp.runtime.device.CPU
    Device("cuda", 1)        # CUDA device 1
    Device.parse("cuda:1")   # the same, from torch's spelling
    str(Device("cuda", 1))   # "cuda:1"

`kind` names the family of memory a backend owns (tpp.runtime.registry looks the backend up by
it); `index` tells devices of one kind apart. A Device is frozen and hashable: it is part of
the signature of every array the runtime has validated, and of the compiled-code cache keys of
device backends.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ArgumentError


@dataclass(frozen=True, slots=True)
class Device:
    kind: str
    index: int = 0

    def __post_init__(self):
        if not isinstance(self.kind, str) or not self.kind.isidentifier():
            raise ArgumentError(f"a device kind is an identifier such as 'cpu' or 'cuda', got "
                                f"{self.kind!r}")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ArgumentError(f"a device index is an int >= 0, got {self.index!r}")

    @property
    def is_host(self) -> bool:
        """Whether this is host memory (the CPU backend's)."""
        return self.kind == "cpu"

    @staticmethod
    def parse(value) -> "Device":
        """A Device from a Device, "kind" or "kind:index" (torch's spelling), or a torch.device."""
        if isinstance(value, Device):
            return value
        kind, index = getattr(value, "type", None), getattr(value, "index", None)
        if isinstance(kind, str):        # a torch.device
            return Device(kind, 0 if index is None else index)
        if isinstance(value, str):
            kind, sep, index = value.partition(":")
            if not sep:
                return Device(kind)
            if index.isdigit():
                return Device(kind, int(index))
        raise ArgumentError(f"expected a device such as 'cpu', 'cuda:0' or Device('cuda', 0), "
                            f"got {value!r}")

    def __str__(self):
        return self.kind if self.is_host else f"{self.kind}:{self.index}"


CPU = Device("cpu")
