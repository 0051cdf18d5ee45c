"""Documentation checks, mpi4py style: a missing docstring fails a test."""

import doctest
import inspect
import pathlib
import re
import subprocess

import pytest

import slamb_comm
from slamb_comm import Communicator


def _has_doc(obj):
    doc = inspect.getdoc(obj)
    return bool(doc and doc.strip())


def test_module_docstring():
    assert _has_doc(slamb_comm)


@pytest.mark.parametrize("name", sorted(slamb_comm.__all__))
def test_public_name_has_docstring(name):
    obj = getattr(slamb_comm, name)
    if isinstance(obj, (str, int, float, tuple, list, dict)):
        pytest.skip(f"{name} is a constant")
    # a class's own docstring, not one inherited from a base class
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    assert doc and doc.strip(), f"slamb_comm.{name} has no docstring"


def _communicator_members():
    out = []
    members = {}
    for cls in reversed(Communicator.__mro__[:-1]):  # its own and its mixins' (the top-k exchange's)
        members.update(vars(cls))
    for name, member in members.items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            out.append(name)
    return sorted(out)


def test_communicator_has_the_exchanges():
    names = _communicator_members()
    for required in ("masked_allreduce", "sparse_allgather", "sync", "state_dict", "load_state_dict"):
        assert required in names


@pytest.mark.parametrize("name", _communicator_members())
def test_communicator_member_has_docstring(name):
    member = inspect.getattr_static(Communicator, name)
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    doc = member.__doc__ if not isinstance(member, property) else member.fget.__doc__
    assert doc and doc.strip(), f"Communicator.{name} has no docstring"


def test_package_doctest():
    result = doctest.testmod(slamb_comm, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, "slamb_comm/__init__.py should carry a runnable example"
    assert result.failed == 0


# ----------------------------------------------------------------------------- the adapters' public names
def _adapter_names():
    out = []
    for mod in ("torch", "horovod", "lightning", "huggingface"):
        try:
            m = __import__(f"slamb_comm.adapters.{mod}", fromlist=["__all__"])
        except ImportError:  # the framework is not installed: its adapter cannot be imported
            continue
        out += [(mod, n) for n in getattr(m, "__all__", [])]
    return out


@pytest.mark.parametrize("mod,name", _adapter_names(), ids=[f"{m}.{n}" for m, n in _adapter_names()])
def test_adapter_public_name_has_docstring(mod, name):
    obj = getattr(__import__(f"slamb_comm.adapters.{mod}", fromlist=[name]), name)
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    assert doc and doc.strip(), f"slamb_comm.adapters.{mod}.{name} has no docstring"


# ----------------------------------------------------------------------------- citations
ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTSIDE = ("ALGO" + "RITHM.md", "../" + "shared")  # spelled so that this file does not cite them


def _repo_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    names = out.stdout.split() if out.returncode == 0 else [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")]
    return [ROOT / n for n in names if n.endswith((".py", ".md", ".cfg", ".sh", ".txt")) and (ROOT / n).is_file()]


def _headings(doc):
    """The section numbers a docs page has: '## 3. Title' gives '3', '### 2.4 Title' gives '2.4'."""
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)*)\.?\s", doc.read_text(), re.M))


def test_every_citation_points_inside_the_repository():
    """No file cites a page outside the repository; every docs page a file names exists, and so
    does every section it names ('docs/algorithm.md section 2', 'sections 1, 2 and 4'), which it
    names as sections (not as a bare '1.4' after the page's name, which this test could not check)."""
    problems = []
    cite = re.compile(r"(?:docs/)?([a-z_]+\.md)`?(?:'s)?,?\s+sections?\s+((?:\d+(?:\.\d+)*(?:,\s*|\s+and\s+)?)+)")
    for f in _repo_files():
        text = f.read_text(errors="replace")
        rel = f.relative_to(ROOT)
        for bad in OUTSIDE:
            if bad in text:
                problems.append(f"{rel}: cites {bad}")
        for page in re.findall(r"docs/([A-Za-z0-9_]+\.md)", text):
            if not (ROOT / "docs" / page).is_file():
                problems.append(f"{rel}: docs/{page} does not exist")
        for page, num in re.findall(r"docs/([A-Za-z0-9_]+\.md)`?\s+(\d[\d.-]*)", text):
            problems.append(f"{rel}: docs/{page} {num}: name it as 'section N' (checked), not a bare number")
        for page, nums in cite.findall(text):
            doc = ROOT / "docs" / page
            if not doc.is_file():
                continue  # another file's name (README.md section ...), not a docs page
            have = _headings(doc)
            for n in re.findall(r"\d+(?:\.\d+)*", nums):
                if n not in have:
                    problems.append(f"{rel}: docs/{page} has no section {n}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_the_readme_links_the_algorithm_in_its_first_screen():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert "docs/algorithm.md" in head
