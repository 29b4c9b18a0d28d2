"""The one rule every headline judges by (``toolkit.runtime.bench.judge``): four words, a band per claim, an
interval that can turn the word, and properties reported as checks. Every lesson's headline goes through it."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from toolkit.report import SENSITIVITY, band
from toolkit.runtime.bench import CHECK_WORDS, CLAIM_WORDS, Claim, check, judge, not_decidable

SOURCES = sorted((Path(__file__).resolve().parents[1] / "notebooks" / "src").glob("[0-9]*.py"))
JUDGES = {"judge", "check", "not_decidable"}


def test_a_ratio_claim_reaches_every_word_and_says_why():
    dcp = Claim.ratio("static / dynamic step", 1.48, tolerance=0.25)
    assert dcp.band == pytest.approx((1.11, 1.85))
    got = {m: judge(dcp, *m, interval="band") for m in [(1.4, 1.3, 1.5), (1.02, 1.02, 1.02), (0.9, 0.85, 0.95),
                                                         (1.05, 0.97, 1.1), (1.3, 1.05, 1.5)]}
    assert [j.word for j in got.values()] == ["reproduced", "direction only", "not reproduced", "not decidable",
                                              "direction only"]
    assert "contains no effect (1)" in got[(1.05, 0.97, 1.1)].why  # a band straddling 1 is never "faster"
    assert "the magnitude does not" in got[(1.3, 1.05, 1.5)].why
    assert got[(1.4, 1.3, 1.5)].text() == "reproduced: 1.4 [1.3, 1.5] (band) — within ±25% of the claimed 1.48×"


def test_a_saving_a_reduction_and_a_claim_of_no_cost():
    saving = Claim.saving("bubble saved", 0.5, at_least=0.5)
    assert [judge(saving, x).word for x in (0.3, 0.2, -0.1)] == ["reproduced", "direction only", "not reproduced"]
    smaller = Claim.ratio("bytes / bf16's", 0.5, tolerance=0.04)
    assert [judge(smaller, x).word for x in (0.516, 0.6, 1.0)] == ["reproduced", "direction only", "not reproduced"]
    free = Claim.at_most("offloaded step / none", 1.05, "'negligible': at most 5 % slower")
    assert judge(free, 1.02, 1.0, 1.04).word == "reproduced" and judge(free, 1.2).word == "not reproduced"
    edge = judge(free, 1.04, 1.0, 1.08, SENSITIVITY)
    assert edge.word == "not decidable" and "crosses the band's edge" in edge.why


def test_claims_and_judgements_refuse_what_cannot_be_judged():
    with pytest.raises(ValueError, match="must contain value"):
        Claim("x", 1.5, (1.0, 2.0), "rule")  # a band that holds "no effect" cannot reproduce an effect
    with pytest.raises(ValueError, match="tolerance"):
        Claim.ratio("x", 1.5, tolerance=1.5)
    with pytest.raises(ValueError, match="not inside"):
        judge(Claim.ratio("x", 1.5), 1.4, 1.45, 1.6)
    with pytest.raises(ValueError, match="True or False"):
        check("x", 1)
    with pytest.raises(ValueError, match="say why"):
        not_decidable("x", "")
    assert judge(Claim.ratio("x", 1.5), None, undecidable="no GPU").why == "no GPU"
    assert judge(Claim.ratio("x", 1.5), math.nan).word == "not decidable"


def test_an_emulated_band_from_replays_turns_the_word():
    claim = Claim.ratio("baseline / technique step", 1.2, tolerance=0.25)
    held = band("step ratio", {"value": 1.2, "band": {"compute x0.7": 1.15, "links x0.8": 1.3}})
    flips = band("step ratio", {"value": 1.1, "band": {"compute x0.7": 0.99, "links x0.8": 1.2}})
    assert judge(claim, held["value"], held["low"], held["high"], SENSITIVITY).word == "reproduced"
    assert judge(claim, flips["value"], flips["low"], flips["high"], SENSITIVITY).word == "not decidable"
    assert judge(claim, 1.1).word == "reproduced"  # the same value without its band would have passed


def _headline_calls(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "headline":
            yield node


TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"


def _judges_inside(name: str, tree: ast.AST | None = None) -> bool:
    """A function ``name`` of the notebook (``tree``) or of the toolkit whose body calls the one rule (a lesson's
    ``verdict``/``verdicts`` helper)."""
    for module in [tree] * (tree is not None) + [ast.parse(p.read_text()) for p in TOOLKIT.rglob("*.py")]:
        for node in ast.walk(module):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return any(isinstance(c, ast.Call) and getattr(c.func, "id", getattr(c.func, "attr", None)) in JUDGES
                           for c in ast.walk(node))
    return False


def _bound_to(tree: ast.AST, var: str) -> list[ast.AST]:
    """The expressions ``var`` is assigned from in ``tree``: a plain assignment's value, or the matching part of
    a tuple unpacked from a tuple (``(b, v), w = x[1], y``), or the whole value when it is unpacked otherwise."""
    def match(target, value):
        if isinstance(target, ast.Name):
            return [value] if target.id == var else []
        if isinstance(target, ast.Tuple):
            if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts):
                return [x for t, v in zip(target.elts, value.elts) for x in match(t, v)]
            return [value] if any(isinstance(n, ast.Name) and n.id == var for n in ast.walk(target)) else []
        return []
    return [x for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets for x in match(t, n.value)]


def _judged_by(expr: ast.AST, tree: ast.AST | None = None, seen: frozenset = frozenset()) -> set[str]:
    """Names of the functions an argument's value can come from: through conditionals, and (with the notebook's
    ``tree``) through the variables, subscripts and unpacked tuples it was assigned from; a toolkit helper that
    calls the one rule itself counts as the rule."""
    if isinstance(expr, ast.IfExp):
        return _judged_by(expr.body, tree, seen) | _judged_by(expr.orelse, tree, seen)
    if isinstance(expr, ast.Call):
        name = getattr(expr.func, "id", getattr(expr.func, "attr", "?"))
        return {"judge"} if name not in JUDGES and _judges_inside(name, tree) else {name}
    if isinstance(expr, ast.Constant) and expr.value is None:
        return {"None"}
    if isinstance(expr, ast.Subscript):  # one item of a dict or tuple of judgements: where the container came from
        return _judged_by(expr.value, tree, seen)
    if isinstance(expr, (ast.DictComp, ast.ListComp)):
        return _judged_by(expr.value if isinstance(expr, ast.DictComp) else expr.elt, tree, seen)
    if isinstance(expr, ast.Name):
        if tree is None or expr.id in seen:
            return {f"name:{expr.id}"}
        bound = _bound_to(tree, expr.id)
        return set().union(*(_judged_by(b, tree, seen | {expr.id}) for b in bound)) if bound else {f"name:{expr.id}"}
    return {type(expr).__name__}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.stem)
def test_every_headline_is_judged_by_the_one_rule(path):
    """Each lesson's headline verdict comes from ``judge``, ``check`` or ``not_decidable`` (never a bare
    boolean), and its emulated verdict too (None only where the run had no emulated cluster)."""
    calls = list(_headline_calls(path))
    assert len(calls) == 1, f"{path.name}: one headline per lesson"
    args = {k.arg: k.value for k in calls[0].keywords}
    source = path.read_text()
    assert _judged_by(args["reproduced"]) <= JUDGES, (path.name, ast.unparse(args["reproduced"]))
    emulated = args.get("emulated_reproduced")
    if emulated is not None and not (isinstance(emulated, ast.Constant) and emulated.value is None):
        names = _judged_by(emulated, ast.parse(source)) - {"None", "Constant"}
        assert names <= JUDGES | {"Dict"}, (path.name, names)
    assert "emulated_band" not in source


def test_the_four_words_and_the_checks_are_the_results_pages_vocabulary():
    from toolkit.report import GLOSSARY
    terms = " ".join(GLOSSARY)
    assert all(w in terms for w in CLAIM_WORDS + CHECK_WORDS)
