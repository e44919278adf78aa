"""Every public name is documented with an example (Optax's rule): a docstring holding a ``>>>``
line (run by the doctests), or, for a constant, an example elsewhere in its module that uses it."""

import inspect
import pathlib
import types

import pytest

import jaxpar

MODULES = [jaxpar, jaxpar.inspect, jaxpar.dataset, jaxpar.metrics, jaxpar.ps]
# The rule-writing API is being reworked on another branch (issue 10: the type a rule receives,
# rule categories, re-registration), which documents it with its example. A ratchet: once a name
# here has an example, this test fails until it is removed from the set.
PENDING: set[str] = set()


def _public(module):
    return [(module.__name__, name, getattr(module, name)) for name in module.__all__
            if not isinstance(getattr(module, name), types.ModuleType)]


def _examples(text):
    return [line for line in (text or "").splitlines() if line.strip().startswith(">>>")]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_public_name_has_a_docstring_with_an_example(module):
    documented = [obj for _, _, obj in _public(module)
                  if inspect.isclass(obj) or callable(obj)]
    all_examples = "\n".join(line for obj in documented + [module]
                             for line in _examples(inspect.getdoc(obj)))
    missing = []
    for _, name, obj in _public(module):
        if inspect.isclass(obj) or callable(obj):
            doc = inspect.getdoc(obj)
            if not doc or not _examples(doc):
                missing.append(name)
        elif name not in all_examples:  # a constant: some example must show it in use
            missing.append(name)
    pending = PENDING if module is jaxpar else set()
    assert sorted(set(missing) - pending) == [], f"{module.__name__}: no docstring example"
    assert sorted(pending - set(missing)) == [], "documented now: remove them from PENDING"


def test_readme_layout_names_every_module():
    root = pathlib.Path(__file__).parent.parent
    readme = (root / "README.md").read_text()
    layout = readme.split("## Layout of the code", 1)[1].split("```")[1]
    modules = sorted(p.relative_to(root) for p in (root / "jaxpar").rglob("*.py")
                     if p.name != "__init__.py" or p.parent.name == "jaxpar")
    missing = [str(p) for p in modules if p.name not in layout]
    assert missing == [], "README's code layout does not name these modules"
