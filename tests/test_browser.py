"""The course as a learner meets it, in a real browser (headless Chromium through Playwright).

1. JupyterLab on 127.0.0.1 (random port and token, ``--LabApp.expose_app_in_browser=True``) opens lesson 03
   at the smoke preset and runs all its cells. Checks: no error output, every plotly figure a cell emitted is
   drawn, each explorer (live ipywidgets and precomputed plotly) changes its figure when a control changes, no
   console errors, and the kernel says busy for the whole of each launch cell (the server's ``/api/kernels``
   polled every 0.25 s, and JupyterLab's own kernel status, against the cells' recorded execution times).
   The saved notebook, opened again, still has working precomputed explorers: the server runs, as ``make lab``
   does, ``toolkit.jupyter``'s pre-save hook, which drops the PNG snapshot the plotly extension stores beside each
   figure (reopened, the extension shows that snapshot instead of the figure). A copy that keeps its snapshots
   comes back as static images: the check can fail.
2. The HTML book built from those executed notebooks (``tools/book.py``) opened from ``file://`` with every
   other request blocked: the same checks, plus page titles, navigation links and rendered math.

Runs with ``make test-browser`` (or ``pytest -m browser``) and inside ``make test``. It drives the system
Chromium (``apt-get install -y chromium``; Playwright's own browser download needs the internet) and skips,
saying so, where there is none.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("TOOLKIT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LESSONS = ["03-dualpipev"]  # figures, a Gantt chart and an explorer; lesson 00 costs the suite 80 s more
PLOTLY = "application/vnd.plotly.v1+json"
RUN_TIMEOUT_S = 600
PNG_1PX = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")

if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM}: install one with `apt-get install -y chromium` (Playwright's own "
                "browser download needs the internet)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (in the project's dev extras)")


# ---------------------------------------------------------------------------------------------- fixtures
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("browser")


@pytest.fixture(scope="module")
def lab(workdir):
    """A JupyterLab server on a copy of the lessons; yields (base url, token, notebook folder)."""
    nbdir, settings = workdir / "notebooks", workdir / "settings"
    nbdir.mkdir()
    for name in LESSONS:
        shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", nbdir)
    # every cell stays in the DOM (JupyterLab 4 virtualises long notebooks by default)
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none", "recordTiming": True}))  # cells' execution times
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    config = workdir / "config"   # this server only: no announcements or update checks (no network)
    config.mkdir()
    (config / "jupyter_server_config.json").write_text(json.dumps(
        {"LabApp": {"news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
                    "extension_manager": "readonly"}}))
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items()  # the learner's bar, from a launch of its own
           if k not in ("TOOLKIT_PLAIN_PROGRESS", "CI", "TOOLKIT_LAUNCH_HOOK", "TOOLKIT_LAUNCH_CACHE")}
    env.update(TOOLKIT_PRESET="smoke", JUPYTER_CONFIG_DIR=str(config), JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
               JUPYTER_DATA_DIR=str(workdir / "data"))  # its own notebook secret and signature store
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True",
           f"--ServerApp.root_dir={nbdir}", f"--LabApp.user_settings_dir={settings}",
           f"--LabApp.workspaces_dir={workdir / 'workspaces'}",
           "--ContentsManager.pre_save_hook=toolkit.jupyter.drop_plotly_snapshots"]  # as `make lab` runs it
    log = open(workdir / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=nbdir, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start:\n" + (workdir / "lab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url, token, nbdir
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the kernels it started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


class Console:
    """Console errors and uncaught exceptions of a page."""

    def __init__(self, page):
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))


# ----------------------------------------------------------------------------------------- page helpers
FIGURE_STATE = """g => JSON.stringify([(g.data || []).map(t => [t.visible, (t.x || []).length, t.name]),
                                     g.layout && g.layout.title && g.layout.title.text])"""


def precomputed_explorers_change(page, prefer: str = "dropdown") -> list[dict]:
    """Change a control of every precomputed explorer (plotly figure with layout.meta.explorer); did it redraw?
    ``prefer="slider"``: drag the first slider's handle to the end of its rail where the figure has one."""
    results = []
    found = page.evaluate("""() => { let n = 0;   // mark them: other figures may be redrawn meanwhile
        for (const g of document.querySelectorAll('.js-plotly-plot'))
            if (g.layout && g.layout.meta && g.layout.meta.explorer) g.setAttribute('data-precomputed', n++);
        return n; }""")
    for i in range(found):
        plot = page.locator(f".js-plotly-plot[data-precomputed='{i}']")
        plot.scroll_into_view_if_needed()
        before = plot.evaluate(FIGURE_STATE)
        grip = plot.locator("g.slider-group rect.slider-grip-rect")
        if prefer == "slider" and grip.count():                           # drag the handle along the rail
            rail = plot.locator("g.slider-group rect.slider-rail-touch-rect").first.bounding_box()
            handle = grip.first.bounding_box()
            page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
            page.mouse.down()
            page.mouse.move(rail["x"] + rail["width"] - 4, handle["y"] + handle["height"] / 2, steps=8)
            page.mouse.up()
            control = "slider (dragged)"
        elif plot.locator("g.updatemenu-header-group").count():          # a dropdown: open it, pick the last item
            plot.locator("g.updatemenu-header-group").first.click()
            plot.locator("g.updatemenu-dropdown-button").last.click()
            control = "dropdown"
        else:                                                          # a slider: click the end of its rail
            box = plot.locator("g.slider-group rect.slider-rail-touch-rect").first.bounding_box()
            page.mouse.click(box["x"] + box["width"] - 4, box["y"] + box["height"] / 2)
            control = "slider"
        try:
            page.wait_for_function(f"([g, b]) => ({FIGURE_STATE})(g) !== b", arg=[plot.element_handle(), before],
                                   timeout=10_000)
            changed = True
        except sync_api.TimeoutError:
            changed = False
        results.append({"control": control, "changed": changed})
    return results


def live_explorers_change(page) -> list[dict]:
    """Change a control of every live (ipywidgets) explorer; did the figure in its output redraw?"""
    results = []
    boxes = page.locator(".toolkit-explorer")
    for i in range(boxes.count()):
        box = boxes.nth(i)
        box.scroll_into_view_if_needed()
        plot = box.locator(".js-plotly-plot").first
        plot.wait_for(timeout=60_000)
        cut = box.evaluate("b => Array.from(b.querySelectorAll('.widget-label'))"
                           ".filter(l => l.scrollWidth > l.clientWidth + 1).map(l => l.textContent)")
        before = plot.evaluate(FIGURE_STATE)
        select = box.locator("select")
        if select.count():
            options = select.first.locator("option").all_inner_texts()
            select.first.select_option(label=options[-1])
            control = "dropdown"
        else:
            handle = box.locator(".noUi-handle, .ui-slider-handle, [role=slider]").first
            handle.focus()
            for _ in range(2):
                handle.press("ArrowRight")
            control = "slider"
        try:
            page.wait_for_function(
                f"([b, s]) => {{ const g = b.querySelector('.js-plotly-plot'); return g && ({FIGURE_STATE})(g) !== s; }}",
                arg=[box.element_handle(), before], timeout=60_000)
            changed = True
        except sync_api.TimeoutError:
            changed = False
        results.append({"control": control, "changed": changed, "cut_labels": cut})
    return results


# -------------------------------------------------------------------------------------------- JupyterLab
NOTEBOOK_STATE = """path => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!w || !w.content || !w.sessionContext || !w.sessionContext.session || w.context.path !== path) return null;
  const kernel = w.sessionContext.session.kernel;
  const cells = w.content.widgets.filter(c => c.model.type === 'code').map(c => c.model.toJSON());
  return {kernel: kernel ? kernel.status : null, kernel_id: kernel ? kernel.id : null,
          cells: cells.map(c => ({count: c.execution_count, source: String(c.source).slice(0, 300),
          timing: (c.metadata && c.metadata.execution) || null,
          errors: (c.outputs || []).filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue),
          plotly: (c.outputs || []).filter(o => o.data && o.data['%s']).length}))};
}""" % PLOTLY


class KernelPolls:
    """The server's view of a kernel while a notebook runs: ``/api/kernels`` every ``every`` seconds on a thread,
    ``(time.time(), execution_state)`` of the kernel ``kernel_id`` (what JupyterLab's status bar shows too)."""

    def __init__(self, url: str, token: str, kernel_id: str, every: float = 0.25):
        self.url, self.token, self.kernel_id, self.every = url, token, kernel_id, every
        self.samples: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                kernels = json.loads(urllib.request.urlopen(f"{self.url}/api/kernels?token={self.token}",
                                                            timeout=5).read())
                state = next((k["execution_state"] for k in kernels if k["id"] == self.kernel_id), None)
                self.samples.append((time.time(), state))
            except OSError:
                pass
            self._stop.wait(self.every)

    def __enter__(self) -> "KernelPolls":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def launch_windows(cells: list[dict], margin: float = 0.3):
    """``(first line, start, end)`` of each code cell that calls ``launch(``: from its execute_input to its
    execute_reply as JupyterLab recorded them, less ``margin`` at both ends."""
    for cell in cells:
        timing = cell.get("timing") or {}
        if "launch(" in cell["source"] and {"iopub.execute_input", "shell.execute_reply"} <= set(timing):
            yield (cell["source"].splitlines()[0][:60], _seconds(timing["iopub.execute_input"]) + margin,
                   _seconds(timing["shell.execute_reply"]) - margin)


def busy_during_launches(cells: list[dict], samples: list[tuple[float, str]]) -> list[dict]:
    """The server's polls taken while each launch cell ran, how many said busy, and the longest run of idle
    polls in a row."""
    out = []
    for cell, lo, hi in launch_windows(cells):
        states = [state for t, state in samples if lo <= t <= hi]
        run = longest = 0
        for state in states:
            run = run + 1 if state != "busy" else 0
            longest = max(longest, run)
        out.append({"cell": cell, "seconds": round(hi - lo, 1), "polls": len(states),
                    "busy": sum(s == "busy" for s in states), "idle_in_a_row": longest})
    return out


def idle_during_launches(cells: list[dict], changes: list[tuple[float, str]]) -> list[dict]:
    """JupyterLab's kernel status (what its status bar shows), from its status changes: the seconds it said
    anything but busy while each launch cell ran, and its longest such spell."""
    out = []
    for cell, lo, hi in launch_windows(cells):
        spells, ends = [], [t for t, _ in changes[1:]] + [float("inf")]
        for (t, state), end in zip(changes, ends):
            if state != "busy" and min(end, hi) > max(t, lo):
                spells.append(min(end, hi) - max(t, lo))
        out.append({"cell": cell, "seconds": round(hi - lo, 1), "idle_s": round(sum(spells), 4),
                    "longest_idle_s": round(max(spells, default=0.0), 4)})
    return out


PRECOMPUTED = """() => Array.from(document.querySelectorAll('.jp-Notebook .js-plotly-plot'))
                       .filter(g => g.layout && g.layout.meta && g.layout.meta.explorer).length"""


def reopened_explorers(browser, url: str, token: str, path: str, workspace: str, shots: Path) -> dict:
    """Open a saved notebook afresh (its outputs as the file has them): does dragging a slider of each precomputed
    explorer redraw it? (``static``: plotly outputs drawn as images.) Widget views of the kernel that ran it are
    gone; their console errors ("widget model not found") are left out."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    console = Console(page)
    page.goto(f"{url}/lab/workspaces/{workspace}/tree/{path}?reset&token={token}")
    page.wait_for_function(f"p => {{ const s = ({NOTEBOOK_STATE})(p); return s && s.kernel === 'idle'; }}",
                           arg=path, timeout=180_000)
    figures = page.locator(".jp-Notebook .jp-RenderedPlotly")
    for i in range(figures.count()):  # plotly draws a figure once it is in view
        figures.nth(i).scroll_into_view_if_needed()
    shown = ("() => Array.from(document.querySelectorAll('.jp-RenderedPlotly img.plot-img'))"
             ".filter(i => i.style.display !== 'none').length")
    try:  # explorers drawn, or their snapshots shown instead (then they never will be)
        page.wait_for_function(f"() => ({PRECOMPUTED})() > 0 || ({shown})() > 0", timeout=30_000)
    except sync_api.TimeoutError:
        pass
    static = page.evaluate(shown)
    result = {"static": static, "precomputed": precomputed_explorers_change(page, prefer="slider")}
    page.screenshot(path=str(shots / f"{workspace}.png"))
    result["console"] = [e for e in console.errors if "widget model not found" not in e]
    context.close()
    return result


@pytest.fixture(scope="module")
def lab_runs(lab, browser, workdir):
    """Each lesson opened and run in JupyterLab: what the learner would see (one entry per lesson)."""
    url, token, nbdir = lab
    runs = {}
    for name in LESSONS:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        console = Console(page)
        path = f"{name}.ipynb"  # a fresh workspace per lesson: only this notebook open
        page.goto(f"{url}/lab/workspaces/{name}/tree/{path}?reset&token={token}")
        page.wait_for_function(f"p => {{ const s = ({NOTEBOOK_STATE})(p); return s && s.kernel === 'idle'; }}",
                               arg=path, timeout=180_000)
        kernel_id = page.evaluate(NOTEBOOK_STATE, path)["kernel_id"]
        page.evaluate("""() => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
            window.__status = [[Date.now() / 1000, k.status]];
            k.statusChanged.connect((_, status) => window.__status.push([Date.now() / 1000, status])); }""")
        start = time.monotonic()
        with KernelPolls(url, token, kernel_id) as polls:
            page.evaluate("""async () => { await window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs');
                                          await window.jupyterapp.commands.execute('notebook:run-all-cells'); }""")
            page.wait_for_function(  # every code cell ran, or one failed (run-all stops there); the kernel is idle
                f"""p => {{ const s = ({NOTEBOOK_STATE})(p); if (!s || s.kernel !== 'idle') return false;
                    return s.cells.every(c => c.count !== null) || s.cells.some(c => c.errors.length); }}""",
                arg=path, timeout=RUN_TIMEOUT_S * 1000, polling=1000)
        seconds = time.monotonic() - start
        state = page.evaluate(NOTEBOOK_STATE, path)
        lab_status = [(t, s) for t, s in page.evaluate("() => window.__status")]
        expected = sum(c["plotly"] for c in state["cells"])
        drawn = "() => document.querySelectorAll('.jp-Notebook .jp-OutputArea-output .js-plotly-plot').length"
        outside = ("() => Array.from(document.querySelectorAll('.jp-Notebook .js-plotly-plot'))"
                   ".filter(g => !g.closest('.toolkit-explorer')).length")
        try:
            page.wait_for_function(f"() => ({outside})() >= {expected}", timeout=60_000)
        except sync_api.TimeoutError:
            pass
        run = {"seconds": seconds, "errors": [e for c in state["cells"] for e in c["errors"]],
               "unrun": sum(c["count"] is None for c in state["cells"]), "expected_figures": expected,
               "figures": page.evaluate(outside), "all_figures": page.evaluate(drawn),
               "busy": busy_during_launches(state["cells"], polls.samples),
               "lab_idle": idle_during_launches(state["cells"], lab_status),
               "live": live_explorers_change(page), "precomputed": precomputed_explorers_change(page)}
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=60_000)
        page.screenshot(path=str(workdir / f"lab-{name}.png"))
        run["console"] = list(console.errors)
        context.close()
        # opened again as JupyterLab saved it; and a copy with the plotly extension's PNG snapshots kept
        saved = nbformat.read(nbdir / path, as_version=4)
        run["snapshots_saved"] = sum("image/png" in o.get("data", {}) for c in saved.cells
                                     for o in c.get("outputs", []) if PLOTLY in o.get("data", {}))
        run["reopened"] = reopened_explorers(browser, url, token, path, f"{name}-reopened", workdir)
        for cell in saved.cells:
            for out in cell.get("outputs", []):
                if PLOTLY in out.get("data", {}):
                    out["data"]["image/png"] = PNG_1PX
        nbformat.write(saved, nbdir / f"{name}-snapshots.ipynb")
        run["snapshots"] = reopened_explorers(browser, url, token, f"{name}-snapshots.ipynb", f"{name}-snapshots",
                                              workdir)
        runs[name] = run
    return runs


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_runs_in_jupyterlab(lab_runs, name):
    run = lab_runs[name]
    print(f"{name}: {run['seconds']:.1f} s in JupyterLab, {run['figures']} figures, live {run['live']}, "
          f"precomputed {run['precomputed']}")
    assert not run["errors"], f"error outputs: {run['errors']}"
    assert run["unrun"] == 0, f"{run['unrun']} code cells did not run"
    assert run["expected_figures"] > 0
    assert run["figures"] == run["expected_figures"], \
        f"{run['figures']} plotly figures drawn, the cells emitted {run['expected_figures']}"
    assert run["live"] and all(r["changed"] for r in run["live"]), f"live explorers: {run['live']}"
    assert not any(r["cut_labels"] for r in run["live"]), f"widget labels cut: {run['live']}"
    assert run["precomputed"] and all(r["changed"] for r in run["precomputed"]), \
        f"precomputed explorers: {run['precomputed']}"
    assert not run["console"], "console errors:\n" + "\n".join(run["console"])


@pytest.mark.parametrize("name", LESSONS)
def test_the_kernel_says_busy_for_the_whole_of_a_launch_cell(lab_runs, name):
    """JupyterLab asks the kernel for a subshell when the launch's bar opens the first widget comm; ipykernel's
    idle status for that control request made the server and the status bar say "Idle" for the rest of the
    launch (5 of 48 polls busy in a 13 s launch). Now it says busy again at once: no idle spell of 0.1 s."""
    run = lab_runs[name]
    print(f"{name}: server {run['busy']}, JupyterLab {run['lab_idle']}")
    assert run["busy"] and all(c["polls"] >= 3 for c in run["busy"]), run["busy"]
    # a poll can fall between the subshell's idle and the cell's busy, sent one after the other: never two
    assert all(c["idle_in_a_row"] <= 1 and c["busy"] >= 0.9 * c["polls"] for c in run["busy"]), run["busy"]
    assert run["lab_idle"] and all(c["longest_idle_s"] < 0.1 for c in run["lab_idle"]), run["lab_idle"]


@pytest.mark.parametrize("name", LESSONS)
def test_a_saved_notebook_reopens_with_working_explorers(lab_runs, name):
    """Saved by JupyterLab (with the pre-save hook `make lab` runs) and opened again: no PNG snapshot was saved
    beside a figure, and a dragged slider of each precomputed explorer redraws it. The same notebook with the
    snapshots kept comes back as static images (what a learner met before the hook)."""
    run = lab_runs[name]
    print(f"{name}: snapshots saved {run['snapshots_saved']}; reopened {run['reopened']}; with snapshots "
          f"{run['snapshots']}")
    got = run["reopened"]
    assert run["snapshots_saved"] == 0 and not got["static"] and got["precomputed"], got
    assert all(r["changed"] and r["control"].startswith("slider") for r in got["precomputed"]), got
    assert not got["console"], got["console"]
    assert run["snapshots"]["static"] and not run["snapshots"]["precomputed"], run["snapshots"]


# ------------------------------------------------------------------------------------------ the HTML book
def _math_notebook() -> nbformat.NotebookNode:
    """A page with math, so the book's MathJax is checked too (lessons 00 and 03 have none)."""
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "# 99 · Offline check\n\nInline $a^2 + b^2 = c^2$, and displayed:\n\n"
        "$$\\text{QSNR} = 10\\log_{10}\\frac{\\text{RMS}^2}{s^2/12}$$")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


@pytest.fixture(scope="module")
def book(lab_runs, lab, workdir):
    """The HTML book built from the notebooks JupyterLab ran and saved."""
    sys.path.insert(0, str(ROOT / "tools"))
    import book as book_module
    _, _, nbdir = lab
    out = workdir / "out"
    (out / "notebooks").mkdir(parents=True)
    for name in LESSONS:
        shutil.copy(nbdir / f"{name}.ipynb", out / "notebooks")
    nbformat.write(_math_notebook(), out / "notebooks" / "99-offline-check.ipynb")
    rows = [{"name": n, "status": "ok", "seconds": lab_runs[n]["seconds"], "error": ""} for n in LESSONS]
    pages = book_module.build(out, rows, {"preset": "smoke"})
    return out, pages


def test_book_opens_offline(book, browser, workdir):
    out, pages = book
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    requested = []
    context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                  else (requested.append(route.request.url), route.abort()))
    problems = []
    for page_info in pages:
        page = context.new_page()
        console = Console(page)
        path = out / "html" / page_info["href"]
        page.goto(path.as_uri())
        page.wait_for_load_state("load")
        name = page_info["name"]
        if page.title() != page_info["title"] or not page.title().startswith(name[:2]):
            problems.append(f"{name}: title {page.title()!r}")
        for href in page.eval_on_selector_all("nav.book-nav a", "els => els.map(a => a.getAttribute('href'))"):
            if not (path.parent / href).exists():
                problems.append(f"{name}: navigation link {href} leads nowhere")
        try:
            page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot').length >= "
                                   f"{page_info['figures']}", timeout=30_000)
        except sync_api.TimeoutError:
            pass
        drawn = page.evaluate("() => document.querySelectorAll('.js-plotly-plot .main-svg').length > 0 ? "
                              "document.querySelectorAll('.js-plotly-plot').length : 0")
        if drawn != page_info["figures"]:
            problems.append(f"{name}: {drawn} of {page_info['figures']} figures drawn")
        explorers = precomputed_explorers_change(page)
        if name in LESSONS and not explorers:
            problems.append(f"{name}: no precomputed explorer on the page")
        if not all(r["changed"] for r in explorers):
            problems.append(f"{name}: explorers {explorers}")
        if "$" in "".join(c.source for c in nbformat.read(out / "notebooks" / f"{name}.ipynb", 4).cells
                          if c.cell_type == "markdown"):
            try:
                page.wait_for_function("() => document.querySelectorAll('mjx-container svg').length > 0",
                                       timeout=30_000)
            except sync_api.TimeoutError:
                problems.append(f"{name}: math not rendered")
        page.screenshot(path=str(workdir / f"book-{name}.png"))
        problems += [f"{name}: {e}" for e in console.errors]
        page.close()
    index = context.new_page()
    console = Console(index)
    index.goto((out / "index.html").as_uri())
    links = index.eval_on_selector_all("table a", "els => els.map(a => a.getAttribute('href'))")
    problems += [f"index: link {h} leads nowhere" for h in links if not (out / h).exists()]
    if "Course run time" not in index.inner_text("body"):
        problems.append("index: no course run time")
    problems += [f"index: {e}" for e in console.errors]
    context.close()
    assert not requested, f"the book asked the network for {requested}"
    assert not problems, "\n".join(problems)
