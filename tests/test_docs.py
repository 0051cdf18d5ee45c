"""Documentation checks, mpi4py style: a missing docstring fails a test."""

import doctest
import inspect

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
    for name, member in vars(Communicator).items():
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
    member = vars(Communicator)[name]
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    doc = member.__doc__ if not isinstance(member, property) else member.fget.__doc__
    assert doc and doc.strip(), f"Communicator.{name} has no docstring"


def test_package_doctest():
    result = doctest.testmod(slamb_comm, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, "slamb_comm/__init__.py should carry a runnable example"
    assert result.failed == 0
