"""Names kept for one release after a rename, with a DeprecationWarning where they are used."""

import warnings

__all__ = ["renamed"]


def renamed(module, **aliases):
    """A module-level ``__getattr__`` for ``module`` (its ``__name__``) that answers each old name
    of ``aliases`` (old name -> the object now under its new name) with a DeprecationWarning
    naming the new one."""

    def __getattr__(name):
        if name not in aliases:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new = aliases[name]
        warnings.warn(f"{module}.{name} is now {new.__name__} (the torch optimizer keeps its name); the old name "
                      "goes in the next release", DeprecationWarning, stacklevel=2)
        return new

    return __getattr__
