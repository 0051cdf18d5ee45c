"""The house's rules, counted from the code's own syntax trees (issue 44), never by running it.

* **Layers.** The core's four layers (docs/core.md, "The map") import only downward: ``device`` nothing
  above ``arrays``/``errors``, ``wire`` the device layer, ``exchange`` the wire, ``methods`` the exchange;
  the core imports neither torch nor horovod (the subprocess check of tests/test_isolation.py proves it
  at run time).
* **No object reaches into another's private attributes**: no ``x._name`` where ``x`` is not ``self`` or
  ``cls``, and no ``self._name`` where ``_name`` is defined only in another class of the class's MRO (a
  base, or a subclass the base relies on). In ``adapters/``, the framework attributes that have no public
  form (autograd's, torch's ``_foreach_*``, Lightning's, the Trainer's) are reached in one module,
  ``adapters/privates.py``, one function each with the reason.
* **Sizes**: no class over 300 lines, no function over 60, no module over 600.
"""

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"slamb_comm": "slamb_comm", "adapters": "slamb_comm.adapters"}
LAYERS = ["device", "wire", "exchange", "methods"]  # bottom to top
#: the one module of adapters/ allowed to reach a framework's private attributes
FRAMEWORK_PRIVATES = os.path.join("adapters", "privates.py")


class _Module:
    def __init__(self, path, name):
        self.path, self.name = path, name
        self.tree = ast.parse(open(path, encoding="utf-8").read(), path)
        self.classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        self.imports = {}  # local name -> (module, name)
        for n in self.tree.body:
            if isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - n.level + 1] + ([n.module] if n.module else []))
                for a in n.names:
                    self.imports[a.asname or a.name] = (base, a.name)


def _modules():
    out = {}
    for folder, package in PACKAGES.items():
        top = os.path.join(ROOT, folder)
        for d, _, files in os.walk(top):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    rel = os.path.relpath(path, top)[:-3].replace(os.sep, ".")
                    name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                    out[name] = _Module(path, name)
    return out


MODULES = _modules()


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(cls):
    """The names a class defines: its body's functions and assignments, and every ``self.x = ...``."""
    out = set()
    for b in cls.body:
        if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(b.name)
        elif isinstance(b, ast.Assign):
            out |= {t.id for t in b.targets if isinstance(t, ast.Name)}
        elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
            out.add(b.target.id)
    for sub in ast.walk(cls):
        if isinstance(sub, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                out |= {e.attr for e in ast.walk(t)
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"}
    return out


def _resolve(mod, name, depth=0):
    """``(module, ClassDef)`` of the class ``name`` means in ``mod``, or None (a framework's class)."""
    if name in mod.classes:
        return mod, mod.classes[name]
    if name in mod.imports and depth < 5:
        where, real = mod.imports[name]
        if where in MODULES:
            return _resolve(MODULES[where], real, depth + 1)
    return None


def _mro(mod, cls):
    out, todo, seen = [], [(mod, cls)], set()
    while todo:
        m, c = todo.pop(0)
        if (m.name, c.name) in seen:
            continue
        seen.add((m.name, c.name))
        out.append((m, c))
        for b in c.bases:
            r = _resolve(m, b.id if isinstance(b, ast.Name) else getattr(b, "attr", ""))
            if r is not None:
                todo.append(r)
    return out


def _reaches():
    """Every access of another object's private attribute: ``(where, what)``."""
    subclasses = defaultdict(set)  # (module, class) -> the names its project subclasses define
    for m in MODULES.values():
        for c in m.classes.values():
            for bm, bc in _mro(m, c)[1:]:
                subclasses[(bm.name, bc.name)] |= _defined(c)
    found = []
    for m in MODULES.values():
        if m.path.endswith(FRAMEWORK_PRIVATES):
            continue
        for cls_node in [None, *m.classes.values()]:
            nodes = [cls_node] if cls_node is not None else [n for n in m.tree.body if not isinstance(n, ast.ClassDef)]
            for top in nodes:
                for node in ast.walk(top):
                    if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                        continue
                    v, where = node.value, f"{os.path.relpath(m.path, ROOT)}:{node.lineno}"
                    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                        continue
                    if isinstance(v, ast.Name) and v.id in ("self", "cls") and cls_node is not None:
                        chain = _mro(m, cls_node)
                        if node.attr in _defined(cls_node):
                            continue
                        if any(node.attr in _defined(c) for _, c in chain[1:]):
                            found.append((where, f"self.{node.attr} of {cls_node.name}, defined only in a base"))
                        elif node.attr in subclasses[(m.name, cls_node.name)]:
                            found.append((where, f"self.{node.attr} of {cls_node.name}, defined only in a subclass"))
                        continue
                    if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                        continue
                    found.append((where, f"{ast.unparse(v)[:40]}.{node.attr}"))
    return found


def _imports(m):
    """Every module ``m`` imports, anywhere in it (a function's own imports too), as absolute names."""
    package = m.name if m.path.endswith("__init__.py") else m.name.rpartition(".")[0]
    out = set()
    for n in ast.walk(m.tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - n.level + 1] + ([n.module] if n.module else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in n.names}
    return out


def _layer(name):
    """The layer of core module ``name`` (its index in :data:`LAYERS`), -1 for arrays and errors."""
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


def test_the_core_is_four_layers_that_import_only_downward():
    wrong = []
    for m in MODULES.values():
        if m.name.startswith("slamb_comm.adapters") or m.name == "slamb_comm":  # the package's face re-exports
            continue
        for target in _imports(m):
            if target.split(".")[0] in ("torch", "horovod", "lightning", "transformers"):
                wrong.append((m.name, target))
            elif target.startswith("slamb_comm.") and _layer(target) > _layer(m.name):
                wrong.append((m.name, target))
    top = os.path.join(ROOT, "slamb_comm")
    rooms = [f for f in os.listdir(top) if f != "__pycache__" and f != "__init__.py"
             and (f.endswith(".py") or os.path.isdir(os.path.join(top, f)))]
    assert not wrong, wrong
    assert len(rooms) <= 6, sorted(rooms)


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_no_object_reaches_into_another_objects_private_attributes(folder):
    found = [r for r in _reaches() if r[0].startswith(folder + os.sep)]
    assert not found, "\n".join(f"{w}: {what}" for w, what in found)


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_no_class_over_300_lines_no_function_over_60_no_module_over_600(folder):
    big = []
    for m in MODULES.values():
        if not os.path.relpath(m.path, ROOT).startswith(folder + os.sep):
            continue
        lines = len(open(m.path, encoding="utf-8").read().splitlines())
        if lines > 600:
            big.append((m.path, "module", lines))
        for n in ast.walk(m.tree):
            size = getattr(n, "end_lineno", 0) - getattr(n, "lineno", 0) + 1
            if isinstance(n, ast.ClassDef) and size > 300:
                big.append((m.path, n.name, size))
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 60:
                big.append((m.path, n.name, size))
    assert not big, big
