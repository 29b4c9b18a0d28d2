"""A lesson's headline result, for the course results page: recorded in the notebook, collected from it.

The last cells of every lesson notebook call ``headline(...)`` once with what its run measured (a ratio, dB,
bytes, a peak), what the source claims, and whether the run reproduces it — values computed in the notebook
from its own results, never typed in. ``headline`` displays one line of markdown and attaches the same record
as JSON to that output under its own MIME type, so the record lives *in the executed notebook*::

    notebook cell          headline(...)  ─► display({"text/markdown": "...", MIME: {record}})
    papermill / JupyterLab the output is saved in the .ipynb like any other (no files, no environment)
    tools/run_all.py       collect(executed .ipynb) ─► records ─► out/results.json, out/results.html

It works the same under plain papermill, in JupyterLab and in ``make run``; a notebook run twice keeps only
its last record per lesson (``collect`` returns the last).
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

from toolkit.runtime.bench import CHECK_WORDS, CLAIM_WORDS, Judgement

MIME = "application/vnd.llm-scale-toolkit.headline+json"
FIELDS = ("lesson", "technique", "measured", "value", "unit", "claim", "source", "reproduced", "note", "emulated",
          "emulated_reproduced")
SENSITIVITY = "the model's sensitivity band: achieved compute x0.7-1.3, links x0.8-1.2"
"""What an emulated judgement's interval is (``band``)."""


def _judgement(name: str, v) -> dict | None:
    if v is None:
        return None
    d = v.to_dict() if isinstance(v, Judgement) else v
    if not isinstance(d, dict) or d.get("word") not in CLAIM_WORDS + CHECK_WORDS:
        raise ValueError(f"{name} must be a judgement of the run (toolkit.runtime.bench.judge(claim, ...) for a "
                         f"source's claim, bench.check(...) for a property), got {v!r}")
    return d


def record(lesson: str, technique: str, measured: str, value: float | int | None = None, unit: str = "",
           claim: str = "", source: str = "", reproduced=None, note: str = "", emulated: str = "",
           emulated_reproduced=None) -> dict:
    """The headline as a JSON-able dict; ValueError for a missing lesson/technique/measurement or a bad value.

    ``measured``: the run's headline in words with its number ("int8 all-to-all: 1.94x fewer bytes"); ``value``
    the number itself (for sorting and plots); ``claim``: the source's number or statement; ``reproduced``: the
    run's judgement of that claim (``bench.judge``: reproduced, direction only, not reproduced, not decidable;
    ``bench.check`` where the headline is a property the setup guarantees, not a reproduction). ``emulated``:
    the time effect measured on the emulated cluster, naming its preset and the workload the run stands for
    (empty when the lesson has none); ``emulated_reproduced``: its judgement against the source's time claim,
    over the model's sensitivity band (``band``)."""
    for name, v in (("lesson", lesson), ("technique", technique), ("measured", measured)):
        if not isinstance(v, str) or not v.strip():
            raise ValueError(f"headline needs a non-empty {name} (a string), got {v!r}")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise ValueError(f"headline value must be a finite number or None, got {value!r}")
        value = float(value) if isinstance(value, float) else int(value)
    if reproduced is None:
        raise ValueError("headline needs reproduced: bench.judge(claim, ...) or bench.check(...), computed from "
                         "the run (bench.judge(claim, None, undecidable='why') where the run cannot tell)")
    reproduced = _judgement("reproduced", reproduced)
    emulated_reproduced = _judgement("emulated_reproduced", emulated_reproduced)
    if emulated_reproduced is not None and not emulated:
        raise ValueError("emulated_reproduced needs the emulated measurement it judges (emulated=...)")
    return {"lesson": lesson, "technique": technique, "measured": measured, "value": value, "unit": unit,
            "claim": claim, "source": source, "reproduced": reproduced, "note": note, "emulated": emulated,
            "emulated_reproduced": emulated_reproduced}


def band(quantity: str, sensitivity: dict, key=None) -> dict:
    """The sensitivity of an emulated number: ``sensitivity`` is what ``Emulator.sensitivity`` returned (the
    quantity replayed at the calibrated figures and across the band of achieved compute x0.7-1.3 and link
    bandwidth x0.8-1.2), ``key`` the number of it the headline judges (a key, a function of a point, or None: it
    is a number). Returns its ``value`` at the calibrated figures and its ``low`` and ``high`` over the band:
    ``bench.judge(claim, b["value"], b["low"], b["high"], SENSITIVITY)`` judges it."""
    pick = key if callable(key) else (lambda v: v[key]) if key else (lambda v: v)
    points = [sensitivity["value"], *sensitivity["band"].values()]
    numbers = [pick(p) for p in points]
    return {"quantity": quantity, "value": numbers[0], "low": min(numbers), "high": max(numbers),
            "replays": len(points)}


def headline(lesson: str, technique: str, measured: str, value: float | int | None = None, unit: str = "",
             claim: str = "", source: str = "", reproduced=None, note: str = "", emulated: str = "",
             emulated_reproduced=None) -> None:
    """Record and display this lesson's headline (see the module docstring). Returns None, so a cell that ends
    with it shows the headline once, not its record again as the cell's value (``record`` gives the dict)."""
    rec = record(lesson, technique, measured, value, unit, claim, source, reproduced, note, emulated,
                 emulated_reproduced)
    try:
        from IPython.display import display
    except ImportError:  # plain Python: nothing to attach the record to
        print(_markdown(rec))
        return
    display({"text/markdown": _markdown(rec), "text/plain": _markdown(rec), MIME: rec}, raw=True)


def judgement_text(j: dict) -> str:
    """A judgement in words: its word, the measured value with its interval, the band that reproduces the
    claim, and why (``bench.Judgement.text``)."""
    return Judgement(**j).text()


def _markdown(rec: dict) -> str:
    claim = f" — source: {rec['claim']}" + (f" ({rec['source']})" if rec["source"] else "") if rec["claim"] else ""
    text = (f"**Headline ({rec['lesson']}, {rec['technique']}).** {rec['measured']}{claim}.\n\n"
            f"**Verdict.** *{judgement_text(rec['reproduced'])}*")
    if rec.get("emulated"):
        text += f"\n\n**Time on the emulated cluster.** {rec['emulated']}."
        if rec.get("emulated_reproduced"):
            text += f"\n\n**Verdict on the emulated cluster.** *{judgement_text(rec['emulated_reproduced'])}*"
    return text


def collect(notebook: str | Path) -> dict | None:
    """The last headline record in an executed notebook (None if it has none)."""
    nb = json.loads(Path(notebook).read_text())
    found = None
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if MIME in data:
                rec = data[MIME]
                found = json.loads(rec) if isinstance(rec, str) else rec
    return found


def write_results(rows: list[dict], out: str | Path, params: dict | None = None,
                  machine: dict | None = None) -> tuple[Path, Path]:
    """``out/results.json`` and ``out/results.html``: one row per lesson (``rows``: ``{"name", "status",
    "headline"}`` with the collected record or None), and the machine they ran on
    (``toolkit.runtime.machine.fingerprint()``, None: not recorded). Returns both paths."""
    out = Path(out)
    (out / "results.json").write_text(json.dumps({"params": params or {}, "machine": machine, "lessons": rows},
                                                 indent=1))
    (out / "results.html").write_text(results_html(rows, params or {}, machine))
    return out / "results.json", out / "results.html"


GLOSSARY: dict[str, str] = {
    "emulated cluster, virtual time": "the lesson's real processes ran with every op timed by a model of the named "
        "GPUs and links (toolkit.runtime.emulator, the notebook's cluster parameter): a model, not a measurement of "
        "a GPU",
    "toy shapes": "the tiny model's own sizes, as the lesson ran them",
    "matched (workload-matched)": "the same ops timed as a real model's: every GEMM at that model's FLOPs and every "
        "tensor at its bytes (ctx.emulator.scaled), so the toy's step stands for the named model's on the emulated "
        "cluster",
    "launch-bound": "the host's cost of issuing each op (a kernel launch), not the GPU's work, sets the step's "
        "time: the kernels are shorter than their launches, as a toy's are",
    "within noise / faster / slower": "toolkit.runtime.bench.verdict on paired rounds: faster or slower only when "
        "the whole 95 % interval of the ratio lies on one side of 1",
    "reproduced / direction only / not reproduced / not decidable": "the run's number judged against the "
        "source's claimed magnitude (toolkit.runtime.bench.judge): reproduced when the number and its interval lie "
        "in the band the claim states, direction only when only the sign holds, not decidable when the interval "
        "contains no effect or the run cannot measure it (e.g. a GPU claim on a CPU), with the number that shows why",
    "check holds / check fails": "a property the setup guarantees (an identity, a closed form, bitwise equality): "
        "it confirms the implementation, it does not reproduce a claim",
    "bubble": "the share of a pipeline step a rank spends idle, waiting for another stage",
    "F&B": "a forward and a backward of two micro-batches run as one pair, so one's communication hides behind "
        "the other's compute (DualPipeV)",
    "exposed communication": "the time a rank waits for a transfer, the part not hidden behind compute",
    "dp · tp · pp · ZeRO-k · b": "a configuration of the planner (planner.label): data-, tensor- and "
        "pipeline-parallel ranks, the ZeRO stage, b sequences per micro-batch, then the schedule with its m "
        "micro-batches, recomputation and offload",
    "a configuration named after a technique (edgc, bf16_residual, ...)": "lesson 17's chain: each configuration is "
        "the one before plus the technique it is named after; edgc is every technique of the chain up to EDGC",
    "S→T state": "what a vocabulary-parallel S pass keeps until its T pass: the rank's softmax and its statistics "
        "(lesson 13)",
    "max/mean load": "the busiest rank's work over the average rank's (1 = balanced)",
    "SNR (dB)": "signal-to-noise ratio of a quantized tensor against the original, in decibels: higher is closer",
    "MFU": "model FLOPs utilisation: the model's FLOPs per second over the GPU's peak",
    "B/param": "bytes of storage per model parameter",
}
"""Terms the headlines use, each in a sentence (the results page's glossary)."""


def _cell(j: dict) -> str:
    cls = "yes" if j["word"] in ("reproduced", "check holds") else "no" if j["word"] in (
        "not reproduced", "check fails") else "none"
    return f"<div class='{cls}'>{html.escape(j['word'])}</div><div class='src'>{html.escape(judgement_text(j))}</div>"


def _bands(judged: list, word: str) -> str:
    rules = sorted({j["rule"] for j in judged if j and j["word"] == word and j["word"] in CLAIM_WORDS})
    return f" ({' | '.join(rules)})" if rules else ""


def results_html(rows: list[dict], params: dict, machine: dict | None = None) -> str:
    """The course results page (self-contained HTML, no scripts)."""
    from toolkit.runtime.machine import describe

    esc = html.escape
    body = []
    for r in rows:
        h = r.get("headline")
        link = f"<a href='html/{esc(r['name'])}.html'>{esc(r['name'])}</a>"
        if h is None:
            why = "notebook failed" if r.get("status") not in (None, "ok") else "no headline recorded"
            body.append(f"<tr><td>{link}</td><td colspan='3' class='none'>{why}</td><td class='none'>-</td>"
                        "<td class='none'>-</td></tr>")
            continue
        verdict = _cell(h["reproduced"])
        claim = esc(h["claim"]) + (f"<div class='src'>{esc(h['source'])}</div>" if h["source"] else "")
        note = f"<div class='src'>{esc(h['note'])}</div>" if h.get("note") else ""
        if h.get("emulated"):
            emulated = f"{esc(h['emulated'])}" + (_cell(h["emulated_reproduced"]) if h.get("emulated_reproduced")
                                                   else "<div class='none'>no time claim judged</div>")
        else:
            emulated = "<span class='none'>-</span>"
        body.append(f"<tr><td>{link}</td><td>{esc(h['technique'])}</td><td>{esc(h['measured'])}{note}</td>"
                    f"<td>{claim}</td><td>{verdict}</td><td>{emulated}</td></tr>")
    judged = [(r.get("headline") or {}).get("reproduced") for r in rows]
    emulated = [(r.get("headline") or {}).get("emulated_reproduced") for r in rows]
    counts = "; ".join(f"{w}: {sum(1 for j in judged if j and j['word'] == w)}" + _bands(judged, w)
                       for w in CLAIM_WORDS + CHECK_WORDS)
    emulated_counts = "; ".join(f"{w}: {sum(1 for j in emulated if j and j['word'] == w)}" + _bands(emulated, w)
                                for w in CLAIM_WORDS)
    glossary = "".join(f"<dt>{esc(term)}</dt><dd>{esc(text)}</dd>" for term, text in GLOSSARY.items())
    return f"""<!doctype html><meta charset="utf-8"><title>llm-scale-toolkit: course results</title>
<style>body{{font-family:Inter,Helvetica,Arial,sans-serif;margin:2em;color:#222;max-width:75em}}
table{{border-collapse:collapse}}dt{{font-weight:600;margin-top:.5em}}dd{{margin-left:1.5em;color:#444}}td,th{{padding:.4em .8em;border-bottom:1px solid #ddd;text-align:left;
vertical-align:top}}.yes{{color:#109618}}.no{{color:#dc3912}}.none{{color:#777}}.src{{color:#777;font-size:.85em}}
</style>
<h1>Course results</h1>
<p>One row per lesson: the headline its run measured, the source's claim, and whether the run reproduces it —
read from each executed notebook's <code>toolkit.report.headline</code> output, never typed in; the terms they use
are in the <a href="#glossary">glossary</a> below. Parameters:
{esc(json.dumps(params))}.</p>
<p>Each claim is judged by one rule (<code>toolkit.runtime.bench.judge</code>): <b>reproduced</b> when the
measured value and its whole interval lie in the band the claim states, <b>direction only</b> when the sign
holds and the magnitude does not, <b>not reproduced</b>, or <b>not decidable</b> with the number that shows
why; a property the setup guarantees is a <b>check</b>, not a reproduction. On the emulated cluster the interval
is {esc(SENSITIVITY)}.</p>
<p>The runs: {esc(counts)}.</p>
<p>On the emulated cluster: {esc(emulated_counts)}.</p>
<p>Machine: {esc(describe(machine)) if machine else "not recorded"}. Times and timing verdicts are this machine's.</p>
<table><tr><th>lesson</th><th>technique</th><th>measured (this run)</th><th>source's claim</th>
<th>reproduced</th><th>time effect on the emulated cluster (virtual time: a model of the named GPUs and links,
fed this run's real ops)</th></tr>
{chr(10).join(body)}</table>
<h2 id="glossary">Glossary</h2>
<dl>{glossary}</dl>"""


__all__ = ["headline", "record", "band", "collect", "write_results", "results_html", "MIME", "GLOSSARY", "SENSITIVITY"]
