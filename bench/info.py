"""`tpp-bench info`: what the numbers were measured on."""
from __future__ import annotations

import os
import platform
import sys

# LLVM feature names worth showing (the full host feature list is long)
ISA_FEATURES = ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                "avx512dq", "avx512vnni", "avx512bf16", "avx512fp16", "amx-tile", "amx-bf16")


def _version(module_name: str):
    try:
        mod = __import__(module_name)
    except Exception as exc:  # noqa: BLE001
        return f"not available ({type(exc).__name__})"
    return getattr(mod, "__version__", "unknown")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def collect() -> dict:
    info: dict = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                    "MKL_NUM_THREADS")},
    }
    try:
        from tpp_cpu import jit, target
        llvm = jit.llvm()
        feats = target.host_features()
        info["llvm_cpu"] = llvm.get_host_cpu_name()
        info["llvm"] = jit.llvm_version()
        info["isa_features"] = {f: bool(feats.get(f)) for f in ISA_FEATURES}
        try:
            info["host_isa"] = target.host_isa()
            t = target.current()
            info["target"] = {"isa": t.isa, "cpu": t.cpu, "lanes": t.lanes,
                              "bf16_dot": t.bf16_dot, "amx": t.amx, "runnable": t.runnable,
                              "TPP_CPU_ISA": os.environ.get("TPP_CPU_ISA", "auto")}
        except Exception as exc:  # noqa: BLE001
            info["target"] = f"unavailable: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001
        info["target"] = f"unavailable: {type(exc).__name__}: {exc}"
    info["gpus"], info["backends"] = _gpus()
    versions = {name: _version(name) for name in ("tpp", "numpy", "llvmlite", "cffi",
                                                  "ml_dtypes", "torch", "cupy")}
    info["versions"] = versions
    try:
        from tpp.runtime import cache
        d = cache.default_directory()
        info["cache_dir"] = str(d) if d is not None else "disabled (TPP_DISK_CACHE=0)"
    except Exception as exc:  # noqa: BLE001
        info["cache_dir"] = f"unavailable: {type(exc).__name__}"
    return info


def _gpus() -> tuple:
    """([GPU descriptions] or a reason there are none, [usable backends])."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except ImportError:
        return "none usable: cupy is not installed (pip install 'tpp[cuda]')", ["cpu"]
    except Exception as exc:  # noqa: BLE001 - no driver, no device
        return f"none usable: {type(exc).__name__}: {str(exc).strip()[:120]}", ["cpu"]
    gpus = []
    for dev in range(count):
        p = cupy.cuda.runtime.getDeviceProperties(dev)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        gpus.append(f"{dev}: {name}, sm_{p['major']}{p['minor']}, "
                    f"{p['totalGlobalMem'] / 2**30:.0f} GiB, {p['multiProcessorCount']} SMs")
    return gpus, ["cpu", "cuda"] if gpus else ["cpu"]


def render(info: dict, file=None) -> None:
    file = file or sys.stdout
    w = 16

    def row(key, value):
        print(f"{key:<{w}} {value}", file=file)
    row("cpu", f"{info.get('cpu_model')} ({info.get('logical_cpus')} logical CPUs)")
    if "llvm_cpu" in info:
        row("llvm cpu", info["llvm_cpu"])
    if "isa_features" in info:
        have = [f for f, on in info["isa_features"].items() if on]
        lack = [f for f, on in info["isa_features"].items() if not on]
        row("isa features", " ".join(have) or "-")
        row("absent", " ".join(lack) or "-")
    t = info.get("target")
    if isinstance(t, dict):
        row("target", f"{t['isa']} ({t['lanes']} f32 lanes, cpu {t['cpu']}, bf16 dot "
                      f"{'yes' if t['bf16_dot'] else 'no'}, amx tiles "
                      f"{'yes' if t.get('amx') else 'no'}; TPP_CPU_ISA={t['TPP_CPU_ISA']})")
    else:
        row("target", t)
    gpus = info.get("gpus")
    row("gpus", gpus if isinstance(gpus, str) else ("; ".join(gpus) or "none"))
    row("backends", ", ".join(info.get("backends", ["cpu"])))
    row("python", f"{info['python']} on {info['platform']}")
    if "llvm" in info:
        row("llvm", info["llvm"])
    for name, v in info["versions"].items():
        row(name, v)
    row("cache dir", info["cache_dir"])
    threads = ", ".join(f"{k}={v}" for k, v in info["threads"].items() if v is not None)
    row("thread env", threads or "(unset)")


def summary_line(info: dict) -> str:
    t = info.get("target")
    isa = t["isa"] if isinstance(t, dict) else "?"
    return (f"{info.get('cpu_model')} | target {isa} | numpy {info['versions']['numpy']} | "
            f"torch {info['versions']['torch']} | llvm {info.get('llvm', '?')}")
