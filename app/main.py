"""``asyncrl ui``: a Gradio app on a run directory (``--run runs/<name>``), a folder of runs to pick
from and overlay (``--run runs/``), and/or a live learner's events socket (``--connect``). Views:
Overview (cards, actors, the runs compared, and every metric its own interactive chart), the tabs the algorithms add (``Workflow.views``: Proposed tasks
for Absolute Zero, Confidence trees for RLCR), Replay buffer, Samples, Config. They update live
(``gr.Timer``) without a page reload.

``/?view=overview|tasks|trees|replay|samples|config`` (a tab's id) opens the page on that view, ``&runs=a,b``
picks runs of a folder (none: its first runs by name), ``&focus=a`` the run the cards, the actors table and
the tabs show (default: the first picked), ``&metrics=x,y`` the metrics charted first (the initial data comes
with the page load, not over the queue). A tab that does not apply to the shown run (an algorithm's tab
for another algorithm, Replay buffer for a run without experience replay) is hidden.

Bound to 127.0.0.1 by default; any other ``--host`` requires ``--auth user:password``. Without
``--auth`` the page is served only with the token in the URL it prints (``?token=...``,
:mod:`app.token_gate`): every local user reaches 127.0.0.1.
"""


import functools
import os
import signal
import socket
import sys
import time
from pathlib import Path
from urllib.parse import quote

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from asyncrl.launcher import UI_TOKEN_ENV  # noqa: E402
from asyncrl.wire.sockets import is_loopback  # noqa: E402

VIEWS = ("overview", "replay", "samples", "config")  # the generic tabs; the algorithms add theirs
MAX_DEFAULT_RUNS = 8  # a folder of runs with none picked shows its first runs by name
MAX_EVENTS_PER_KIND = 5000  # the UI keeps the latest events of each kind (metrics: all steps)


class UIError(ValueError):
    """Bad ``asyncrl ui`` arguments, with what to do instead."""


def check_args(args) -> tuple[str, str] | None:
    """Validate the options; returns the ``(user, password)`` pair or None."""
    if not args.run and not args.connect:
        raise UIError("give --run runs/<name> (a run directory) and/or --connect ADDRESS "
                      "(a live learner's events address, see <run>/addresses.json)")
    if args.run and not Path(args.run).is_dir():
        raise UIError(f"run directory {args.run} does not exist")
    if args.connect and "://" not in args.connect:
        raise UIError(f"--connect wants a ZeroMQ address (the 'events' entry of addresses.json: ipc://PATH, or "
                      f"tcp://HOST:PORT with keys), got {args.connect!r}")
    auth = None
    if args.auth is not None:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            raise UIError("--auth must be user:password (both non-empty)")
        auth = (user, password)
    if bool(getattr(args, "tls_cert", None)) != bool(getattr(args, "tls_key", None)):
        raise UIError("--tls-cert and --tls-key go together (a PEM certificate and its private key)")
    for name in ("tls_cert", "tls_key"):
        path = getattr(args, name, None)
        if path and not Path(path).is_file():
            raise UIError(f"--{name.replace('_', '-')} {path}: no such file")
    if not is_loopback(args.host) and auth is None:
        raise UIError(f"refusing to serve on {args.host!r} without a login: anything but loopback "
                      f"(127.0.0.1, ::1, localhost) requires --auth user:password")
    if not 0 <= args.port <= 65535:
        raise UIError(f"--port must be in 0..65535 (0: a free port), got {args.port}")
    return auth


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _query_list(request, name: str) -> list[str]:
    raw = request.query_params.get(name) if request is not None else None
    return [x for x in (raw or "").split(",") if x]


def build_app(source, live=None, title: str = "asyncrl"):
    """The Gradio Blocks over ``source``: a :class:`app.live.RunCatalog` (one run or a folder of
    runs) or one :class:`asyncrl.analysis.RunStore`.

    Query parameters: ``view`` (the tab), ``runs`` (comma-separated run names to pick, folder of
    runs only; none: the first runs by name), ``metrics`` (comma-separated metrics charted first).

    One long function on purpose: the layout and the event wiring of a Gradio Blocks app refer to
    each other's components, and read best side by side; the content comes from ``app.views``."""
    import gradio as gr

    from asyncrl.analysis import RunStore

    from . import views as V
    from .live import RunCatalog

    catalog = source if isinstance(source, RunCatalog) else RunCatalog(source, name=title)
    empty = RunStore()

    # ``pick``: {"sel": the runs picked, "focus": the run the cards and tabs show}, one per page (a gr.State);
    # None (nothing picked) and a plain list of run names are taken too (an algorithm tab's own handlers)
    def _pick(pick) -> dict:
        if isinstance(pick, dict):
            return {"sel": list(pick.get("sel") or []), "focus": pick.get("focus")}
        return {"sel": list(pick or []), "focus": None}

    def chosen(pick):
        """The picked runs; in a folder of runs with none picked, its first MAX_DEFAULT_RUNS by name."""
        return catalog.stores(_pick(pick)["sel"] or catalog.names()[:MAX_DEFAULT_RUNS])

    def focus_name(pick) -> str | None:
        stores, focus = chosen(pick), _pick(pick)["focus"]
        return focus if focus in stores else next(iter(stores), None)

    def main_store(pick):
        """The run the cards, the actors table and the tabs show (``focus``; else the first picked)."""
        stores = chosen(pick)
        return stores.get(focus_name(pick)) or empty

    def live_status():
        return live.status() if live is not None else None

    def runs_note(pick):
        if catalog.folder is None:
            return ""
        names = catalog.names()
        shown = list(chosen(pick))
        # every run of the folder one click away (the link opens the page on it alone)
        listed = ", ".join(f'<a href="?runs={quote(n)}" class="arl-run-link">{V.esc(n)}</a>' for n in names)
        how = ("picked above" if _pick(pick)["sel"] else f"none picked: the first {len(shown)} by name"
               if len(shown) < len(names) else "none picked: all of them")
        return V.note(f"<span id=\"runs-list\">{len(names)} run(s) in <code>{V.esc(catalog.folder)}</code>"
                      f"{': ' + listed if names else ''}</span>. Shown ({how}): "
                      f"{', '.join(f'<code>{V.esc(n)}</code>' for n in shown)}; the cards, the actors table and the "
                      f"tabs show <code>{V.esc(focus_name(pick))}</code> (pick another below), every chart overlays "
                      f"all of them."
                      if names else f"No runs in <code>{V.esc(catalog.folder)}</code> yet (a run directory holds "
                      f"config.yaml, metrics.jsonl or events.jsonl); the list updates as runs appear.")

    def light(pick):
        store = main_store(pick)
        return runs_note(pick) + V.overview_html(store, live_status()), V.actors_html(store)

    algo_views = V.algorithm_views()

    def view_outputs(view, pick, *inputs):
        store = main_store(pick)
        if not view.applies(store):
            return [view.absent_note(store), gr.update(visible=False), *[gr.skip()] * len(view.outputs)]
        return ["", gr.update(visible=True), *view.render(store, *inputs)]

    def sample_outputs(pick, choice):
        store = main_store(pick)
        choices = V.sample_choices(store)
        valid = {c[1] for c in choices}
        value = choice if choice in valid else (choices[0][1] if choices else None)
        return gr.update(choices=choices, value=value), V.sample_html(store, value)

    def revision_key(pick) -> str:
        stores = chosen(pick)
        return ("|".join(f"{n}:{s.revision}" for n, s in stores.items()) + "#" + ",".join(catalog.names())
                + "@" + str(focus_name(pick)))

    def heavy(key, pick, pins, *args):
        """Every view's content when the run changed; ``pins``: the metrics charted first (``?metrics=``);
        ``args``: each algorithm view's inputs, then the sample choice."""
        new_key = revision_key(pick)
        if key == new_key:
            return [gr.skip()] * len(heavy_out)
        store = main_store(pick)
        names = catalog.names()
        runs = gr.update(choices=names, value=[n for n in _pick(pick)["sel"] if n in names])
        stores = chosen(pick)
        focus = gr.update(choices=list(stores), value=focus_name(pick))
        algo_out, at = [], 0
        for view in algo_views:
            algo_out += view_outputs(view, pick, *args[at:at + len(view.inputs)])
            at += len(view.inputs)
        (choice,) = args[at:]
        hidden = [view.id for view in algo_views if not view.applies(store)]
        hidden += [] if V.has_replay(store) else ["replay"]
        return [V.runs_html(stores) if catalog.folder is not None else "", V.charts_json(stores, pins or []),
                *algo_out, V.replay_html(store), V.replay_figure(store), *sample_outputs(pick, choice),
                V.config_html(store), runs, focus, V.hidden_tabs_css(hidden), new_key]

    def on_load(request: gr.Request, *args):
        view = (request.query_params.get("view") if request is not None else None) or "overview"
        selected = view if view in VIEWS or view in {v.id for v in algo_views} else "overview"
        sel = [n for n in _query_list(request, "runs") if n in catalog.names()]
        pick = {"sel": sel, "focus": (request.query_params.get("focus") if request is not None else None)}
        pins = _query_list(request, "metrics")
        return [gr.Tabs(selected=selected), pick, pins, *light(pick), *heavy("", pick, pins, *args)]

    def picked(sel, focus, *args):
        """The runs picker or the shown-run picker changed: the new pick, then every view."""
        pick = {"sel": list(sel or []), "focus": focus}
        return [pick, *light(pick), *heavy("", pick, *args)]

    with gr.Blocks(title=title) as demo:
        gr.HTML(f'<h2 style="margin:0">asyncrl · {V.esc(title)}</h2>')
        runs_dd = gr.Dropdown(catalog.names(), value=[], multiselect=True, visible=catalog.folder is not None,
                              label="runs (none picked: the first 8 by name; all are overlaid in every chart, the run shown "
                                    "in the cards and the tabs is picked below)",
                              elem_id="runs-picker")
        focus_dd = gr.Dropdown([], value=None, visible=catalog.folder is not None, elem_id="focus-picker",
                               label="run shown in the cards, the actors table and the tabs")
        with gr.Tabs(selected="overview") as tabs:
            with gr.Tab("Overview", id="overview"):
                ov_html = gr.HTML(elem_id="overview")
                ov_actors = gr.HTML(elem_id="actors-view")
                ov_runs = gr.HTML(elem_id="runs-view")
                charts = gr.HTML(value="{}", html_template='<div class="arl-charts" id="charts"></div>',
                                 js_on_load=V.CHARTS_JS, elem_id="charts-view")
            algo_boxes = []  # per algorithm view: its note and its column
            for view in algo_views:
                with gr.Tab(view.title, id=view.id):
                    box_note = gr.HTML()
                    with gr.Column(visible=False) as box:
                        view.build(gr, empty)
                    algo_boxes.append((box_note, box))
            with gr.Tab("Replay buffer", id="replay"):
                rp_html = gr.HTML(elem_id="replay-view")
                rp_plot = gr.Plot(show_label=False, format="png", elem_id="replay-plot")
            with gr.Tab("Samples", id="samples"):
                sm_choice = gr.Dropdown(choices=[], label="sample (newest first)")
                sm_html = gr.HTML(elem_id="samples-view")
            with gr.Tab("Config", id="config"):
                cfg_html = gr.HTML(elem_id="config-tab")
        # the tabs that do not apply to the shown run, hidden by a style rule (Gradio 6.31 draws a tab's
        # button whatever its visible=)
        tab_style = gr.HTML("", elem_id="tab-style", padding=False, container=False)
        rev = gr.State("")
        pins = gr.State([])
        pick = gr.State({"sel": [], "focus": None})
        filters = [c for view in algo_views for c in view.inputs] + [sm_choice]
        algo_out = [c for view, box in zip(algo_views, algo_boxes) for c in (*box, *view.outputs)]
        heavy_out = [ov_runs, charts, *algo_out, rp_html, rp_plot, sm_choice, sm_html, cfg_html, runs_dd, focus_dd,
                     tab_style, rev]
        # the first data comes with the page load (not over the queue)
        demo.load(on_load, inputs=filters, outputs=[tabs, pick, pins, ov_html, ov_actors, *heavy_out],
                  queue=False, show_progress="hidden")
        gr.Timer(2.0).tick(light, inputs=[pick], outputs=[ov_html, ov_actors], show_progress="hidden")
        gr.Timer(5.0).tick(heavy, inputs=[rev, pick, pins, *filters], outputs=heavy_out,
                           show_progress="hidden")
        for picker in (runs_dd, focus_dd):
            picker.input(picked, inputs=[runs_dd, focus_dd, pins, *filters],
                         outputs=[pick, ov_html, ov_actors, *heavy_out], show_progress="hidden")
        for view, box in zip(algo_views, algo_boxes):
            for c in view.inputs:
                c.change(functools.partial(view_outputs, view), inputs=[pick, *view.inputs],
                         outputs=[*box, *view.outputs], show_progress="hidden")
            view.wire(gr, main_store, pick)
        sm_choice.input(lambda p, c: V.sample_html(main_store(p), c), inputs=[pick, sm_choice],
                        outputs=[sm_html])
    return demo


def serve(args) -> int:
    from asyncrl.analysis import RunStore, is_run_dir

    from .live import DirPoller, EventSubscriber, RunCatalog
    from .views import CHARTS_CSS, CSS, algorithm_views

    auth = check_args(args)
    threads = []
    folder = args.run and not is_run_dir(args.run) and not args.connect  # a folder of runs to pick from
    if folder:
        catalog = RunCatalog(folder=args.run, max_events_per_kind=MAX_EVENTS_PER_KIND)
        title = f"runs in {Path(args.run).resolve().name}"
    else:
        store = RunStore(max_events_per_kind=MAX_EVENTS_PER_KIND)
        if args.run:
            poller = DirPoller(args.run, store)
            poller.reader.poll()  # the page has data from the first load
            threads.append(poller)
        title = Path(args.run).resolve().name if args.run else args.connect
        catalog = RunCatalog(store, name=title)
    live = None
    if args.connect:
        live = EventSubscriber(args.connect, catalog.single[1], curve_dir=getattr(args, "curve_dir", None))
        threads.append(live)
    for t in threads:
        t.start()
    demo = build_app(catalog, live, title=title)
    port = args.port or free_port(args.host)
    try:
        from starlette.middleware import Middleware

        from .login_limit import LoginLimiter
        from .token_gate import TokenGate, new_token

        tls = ({"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key, "ssl_verify": False}  # (its own probe of itself)
               if getattr(args, "tls_cert", None) else {})
        middleware = [Middleware(LoginLimiter)]
        token = None
        if auth is None:  # loopback without a login: a token (other local users reach 127.0.0.1 too)
            token = os.environ.pop(UI_TOKEN_ENV, None) or new_token()
            middleware.append(Middleware(TokenGate, token=token))
        demo.launch(server_name=args.host, server_port=port, auth=auth, prevent_thread_lock=True, quiet=True,
                    share=False, css=CSS + CHARTS_CSS + "".join(v.css for v in algorithm_views()), footer_links=[],
                    app_kwargs={"middleware": middleware},
                    **tls)
    except OSError as e:
        raise UIError(f"cannot serve on {args.host}:{port} ({e}); pick another --port (0: any free port)") from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"{'https' if getattr(args, 'tls_cert', None) else 'http'}://{host}:{port}/"
    url += f"?token={token}" if token else ""
    what = (f"folder of runs {args.run}: {len(catalog.names())} run(s) to pick from" if folder else
            f"{'run ' + str(args.run) if args.run else ''}{' + ' if args.run and args.connect else ''}"
            f"{'live events from ' + args.connect if args.connect else ''}")
    print(f"asyncrl ui: serving {url} ({what}); Ctrl-C stops", flush=True)
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stop["now"]:
            time.sleep(0.2)
    finally:
        for t in threads:
            t.stop()
        catalog.stop()
        demo.close()
    return 0


def main(args=None) -> int:
    """Entry point of ``asyncrl ui`` (``args`` from its parser) or ``python -m app.main ARGS``."""
    if args is None or isinstance(args, list):
        from .args import parse_ui_args

        args = parse_ui_args(sys.argv[1:] if args is None else args)
    try:
        return serve(args)
    except (UIError, ValueError, FileNotFoundError) as e:
        print(f"asyncrl ui: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
