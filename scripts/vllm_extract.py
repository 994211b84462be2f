"""Run chosen functions and classes of vLLM 0.33.0's own source without installing vLLM.

vLLM's request preprocessing lives in modules that import torch, CUDA-facing config and the
whole engine at import time, none of which the pieces we need use. So instead of importing
those modules we read their source from the wheel, take the named top-level functions,
classes, constants (and single methods of classes) out of the syntax tree, and execute exactly
that code. Every import of the module is attempted; one that fails (torch, vllm.*, openai) binds
its names to inert stand-ins, which the extracted code only meets in annotations and casts.
Nothing of vLLM is copied into this repository: the wheel is unzipped into a temporary
directory at run time.

Used by scripts/gen_vllm_preproc_cases.py and tests/vllm/test_preproc_cases.py.
"""

from __future__ import annotations

import __future__
import ast
import glob
import os
import sys
import tempfile
import types
import zipfile
from pathlib import Path

VLLM_VERSION = "0.33.0"
REPO = Path(__file__).resolve().parent.parent


def find_wheel() -> Path | None:
    """The vLLM wheel cached by scripts/setup-venv.sh (or under $VLLM_WHEEL_DIR)."""
    dirs = [os.environ.get("VLLM_WHEEL_DIR", ""), str(REPO / ".venv" / "vllm-wheel"), "/tmp/vllm-wheel"]
    for d in dirs:
        if d:
            hits = sorted(glob.glob(f"{d}/vllm-{VLLM_VERSION}-*.whl"))
            if hits:
                return Path(hits[0])
    return None


class VllmSource:
    """The wheel's Python files, unzipped into a temporary directory on first use."""

    def __init__(self, wheel: Path):
        self._tmp = tempfile.TemporaryDirectory(prefix="kv-epp-vllm-src-")
        self.root = Path(self._tmp.name)
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    z.extract(name, self.root)

    def path(self, module_path: str) -> Path:
        return self.root / module_path


class _StubMeta(type):
    """A stand-in for a name whose import failed: any attribute, subscript or union is a stub."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return stub(f"{cls.__name__}.{name}")

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls


def stub(name: str):
    return _StubMeta(name, (), {"__init__": lambda self, *a, **k: None})


class QuietLogger:
    """vLLM's `init_logger(...)` result, silenced."""

    def __getattr__(self, name):
        return lambda *a, **k: None


def extract(source: VllmSource, module_path: str, names: list[str], env: dict | None = None) -> dict:
    """Executes the module's imports and the named top-level definitions (``Class.method`` for
    one method, run as a plain function). Returns the namespace."""
    path = source.path(module_path)
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, str(path))
    flags = 0
    module = types.ModuleType("vllm_extract." + module_path.replace("/", ".")[:-3])
    sys.modules[module.__name__] = module  # dataclasses and pydantic look their module up
    ns: dict = module.__dict__
    ns.update(env or {})
    wanted = set(names)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
    picked = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            for alias in node.names:
                bound = (alias.asname or alias.name).split(".")[0]
                if bound in ns:
                    continue
                single = ast.Module(body=[type(node)(**{**node.__dict__, "names": [alias]})], type_ignores=[])
                try:
                    exec(compile(single, str(path), "exec", flags=flags), ns)
                except Exception:
                    ns[bound] = stub(bound)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in wanted:
                picked.append(node)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and f"{node.name}.{item.name}" in wanted:
                        item.decorator_list = []
                        picked.append(item)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in wanted for t in targets):
                picked.append(node)
    found = {getattr(n, "name", None) for n in picked} | {
        t.id for n in picked if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)
    }
    missing = {w.split(".")[-1] for w in wanted} - found
    if missing:
        raise LookupError(f"{module_path}: not found: {sorted(missing)}")
    exec(compile(ast.Module(body=picked, type_ignores=[]), str(path), "exec", flags=flags), ns)
    return ns


def class_field_default(source: VllmSource, module_path: str, class_name: str, field: str):
    """The literal default of a dataclass field, read from the source."""
    tree = ast.parse(source.path(module_path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == field:
                    return ast.literal_eval(item.value)
    raise LookupError(f"{module_path}: {class_name}.{field}")


def literal_args(source: VllmSource, module_path: str, name: str) -> tuple:
    """The arguments of a module-level `Name = Literal[...]` alias."""
    tree = ast.parse(source.path(module_path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return tuple(ast.literal_eval(e) for e in node.value.slice.elts)
    raise LookupError(f"{module_path}: {name}")
