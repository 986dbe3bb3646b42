"""README.md's examples run as printed: every ```python block, each in a fresh interpreter
started outside the repository, on the test session's kernel cache (TPP_CACHE_DIR is
inherited). A block that needs CUDA (it names cupy or cuda) is skipped where no GPU is usable."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.S | re.M)


def _needs_cuda(code: str) -> bool:
    return "cupy" in code or "cuda" in code


def _gpu_usable() -> bool:
    from tpp_cuda import runtime
    return runtime.available()


def _name(code: str) -> str:
    """A test id: the block's first statement that is not an import."""
    lines = [ln for ln in code.splitlines() if ln.strip() and not ln.startswith("import ")]
    return re.sub(r"\W+", "_", lines[0].split("#")[0].strip())[:40] if lines else "empty"


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 5, "the ```python blocks of README.md were not found"
    assert "../shared" not in README.read_text(), "README.md must stand on its own"


@pytest.mark.parametrize("code", BLOCKS, ids=[_name(c) for c in BLOCKS])
def test_readme_block_runs_verbatim(code, tmp_path):
    if _needs_cuda(code) and not _gpu_usable():
        pytest.skip("needs a CUDA GPU and cupy")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"this README block fails:\n{code}\n{done.stderr[-3000:]}"
