"""Every notebook refuses a parameter it cannot run in one call right after its parameters cell
(helpers.parameters.check_parameters): every parameter named there, one error type, one line naming it. Each rule's
edges are tried on the notebook's own call, cheaply: the call alone, not the notebook."""
import ast

import nbformat
import pytest

from helpers import REPO_ROOT, parameters
from helpers.errors import InputError

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9]*.ipynb"))


def cells(path) -> tuple[str, str]:
    """The parameters cell and the code cell after it, which holds the check."""
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    [at] = [i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", [])]
    return code[at].source, code[at + 1].source


def the_call(source: str) -> ast.Call:
    [call] = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
              and getattr(n.func, "id", None) == "check_parameters"]
    return call


def namespace(path) -> dict:
    """What the check's call reads: the parameters, the rules, the names the notebook imports for it (MODEL_SIZES,
    trainable_precisions), this machine's Runtime, and the cell's own small assignments (e.g. 08's last_step)."""
    from helpers.model import MODEL_SIZES
    from helpers.precision import trainable_precisions
    from helpers.runtime import detect
    params, check = cells(path)
    space = {"MODEL_SIZES": MODEL_SIZES, "trainable_precisions": trainable_precisions, "rt": detect(),
             **{name: getattr(parameters, name) for name in ("choice", "either", "increasing", "integer", "number")}}
    exec(params, space)   # noqa: S102 (the notebook's own parameters cell: assignments only)
    call_names = {n.id for n in ast.walk(the_call(check)) if isinstance(n, ast.Name)}
    for node in ast.parse(check).body:   # the cell's own names the call reads (split, last_step)
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in call_names):
            exec(ast.unparse(node), space)   # noqa: S102
    return space


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_one_call_names_every_parameter(path):
    params, check = cells(path)
    assigned = {t.id for n in ast.parse(params).body if isinstance(n, ast.Assign)
                for t in ast.walk(n.targets[0]) if isinstance(t, ast.Name)}
    checked = [k.arg for k in the_call(check).keywords]
    assert sorted(checked) == sorted(assigned), path.name
    assert "raise " not in check and "assert " not in check, f"{path.name}: a second way of refusing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_each_rule_takes_its_edges_and_refuses_past_them_naming_the_parameter(path):
    space = namespace(path)
    rules = {k.arg: eval(ast.unparse(k.value), space) for k in the_call(cells(path)[1]).keywords}   # noqa: S307
    parameters.check_parameters(space, **rules)   # the stored values pass
    for name, rule in rules.items():
        assert rule.edges and rule.outside, name
        for value in rule.edges:
            parameters.check_parameters({**space, name: value}, **rules)
        for value in rule.outside:
            with pytest.raises(InputError, match=f"^{name}="):
                parameters.check_parameters({**space, name: value}, **rules)


def test_a_refusal_is_one_line_that_says_what_to_use():
    with pytest.raises(InputError) as refused:
        parameters.check_parameters({"LR": 0.5}, LR=parameters.number(1e-3, 1e-2))
    assert str(refused.value) == "LR=0.5: use a number from 0.001 to 0.01"
    with pytest.raises(InputError, match=r"^SIZE='huge': use 'auto' or an integer from 16 to 8192$"):
        parameters.check_parameters({"SIZE": "huge"}, SIZE=parameters.either(parameters.choice("auto"),
                                                                            parameters.integer(16, 8192)))
