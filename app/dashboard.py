"""The page of ``asyncrl ui``: its layout (:meth:`Dashboard.layout`), the events that update it
(:meth:`Dashboard.wire`) and what each view shows for the runs picked (the other methods; the HTML
and figures come from :mod:`app.views`).

``pick``: ``{"sel": the runs picked, "focus": the run the cards and tabs show}``, one per page (a
``gr.State``); None (nothing picked) and a plain list of run names are taken too (an algorithm
tab's own handlers pass them)."""

import functools
from urllib.parse import quote

from asyncrl.analysis import RunStore

from . import timeline as TL
from . import tokens as T
from . import views as V

VIEWS = (
    "overview",
    "staleness",
    "timeline",
    "replay",
    "ledger",
    "tokens",
    "samples",
    "config",
)  # the generic tabs; the algorithms add theirs
MAX_DEFAULT_RUNS = 8  # a folder of runs with none picked shows the runs written to last


def _query_list(request, name: str) -> list[str]:
    raw = request.query_params.get(name) if request is not None else None
    return [x for x in (raw or "").split(",") if x]


def _pick(pick) -> dict:
    if isinstance(pick, dict):
        return {"sel": list(pick.get("sel") or []), "focus": pick.get("focus")}
    return {"sel": list(pick or []), "focus": None}


class Dashboard:
    """One Gradio Blocks app over a :class:`app.live.RunCatalog` and an optional live subscriber."""

    def __init__(self, catalog, live=None, title: str = "asyncrl"):
        import gradio as gr

        self.gr, self.catalog, self.live, self.title = gr, catalog, live, title
        self.empty = RunStore()
        self.algo_views = V.algorithm_views()

    # ------------------------------------------------------------------ what the pick shows
    def chosen(self, pick):
        """The picked runs; in a folder of runs with none picked, the MAX_DEFAULT_RUNS written to last."""
        return self.catalog.stores(_pick(pick)["sel"] or self.catalog.newest(MAX_DEFAULT_RUNS))

    def focus_name(self, pick) -> str | None:
        stores, focus = self.chosen(pick), _pick(pick)["focus"]
        return focus if focus in stores else next(iter(stores), None)

    def main_store(self, pick):
        """The run the cards, the actors table and the tabs show (``focus``; else the first picked)."""
        return self.chosen(pick).get(self.focus_name(pick)) or self.empty

    def runs_note(self, pick) -> str:
        catalog = self.catalog
        if catalog.folder is None:
            return ""
        names = catalog.names()
        shown = list(self.chosen(pick))
        if not names:
            return V.note(
                f"No runs in <code>{V.esc(catalog.folder)}</code> yet (a run directory holds "
                f"config.yaml, metrics.jsonl or events.jsonl); the list updates as runs appear."
            )
        # every run of the folder one click away (the link opens the page on it alone)
        listed = ", ".join(f'<a href="?runs={quote(n)}" class="arl-run-link">{V.esc(n)}</a>' for n in names)
        how = (
            "picked above"
            if _pick(pick)["sel"]
            else f"none picked: the first {len(shown)} by name"
            if len(shown) < len(names)
            else "none picked: all of them"
        )
        return V.note(
            f'<span id="runs-list">{len(names)} run(s) in <code>{V.esc(catalog.folder)}</code>'
            f": {listed}</span>. Shown ({how}): "
            f"{', '.join(f'<code>{V.esc(n)}</code>' for n in shown)}; the cards, the actors table and the "
            f"tabs show <code>{V.esc(self.focus_name(pick))}</code> (pick another below), every chart "
            f"overlays all of them."
        )

    def light(self, pick):
        """The cards and the actors table (every 2 s)."""
        store = self.main_store(pick)
        status = self.live.status() if self.live is not None else None
        return self.runs_note(pick) + V.overview_html(store, status), V.actors_html(store)

    def view_outputs(self, view, pick, *inputs):
        store = self.main_store(pick)
        if not view.applies(store):
            return [view.absent_note(store), self.gr.update(visible=False), *[self.gr.skip()] * len(view.outputs)]
        return ["", self.gr.update(visible=True), *view.render(store, *inputs)]

    def picker_outputs(self, pick, choice, list_choices, html):
        """A picker tab (Samples, Tokens): its choices for the shown run, the one kept (else the first)
        and its HTML."""
        store = self.main_store(pick)
        choices = list_choices(store)
        value = choice if choice in {c[1] for c in choices} else (choices[0][1] if choices else None)
        return self.gr.update(choices=choices, value=value), html(store, value)

    def revision_key(self, pick) -> str:
        stores = self.chosen(pick)
        return (
            "|".join(f"{n}:{s.revision}" for n, s in stores.items())
            + "#"
            + ",".join(self.catalog.names())
            + "@"
            + str(self.focus_name(pick))
        )

    def heavy(self, key, pick, pins, *args):
        """Every view's content when the run changed; ``pins``: the metrics charted first (``?metrics=``);
        ``args``: each algorithm view's inputs, then the sample choice and the traced row's."""
        gr = self.gr
        new_key = self.revision_key(pick)
        if key == new_key:
            return [gr.skip()] * len(self.heavy_out)
        store, stores, names = self.main_store(pick), self.chosen(pick), self.catalog.names()
        runs = gr.update(choices=names, value=[n for n in _pick(pick)["sel"] if n in names])
        focus = gr.update(choices=list(stores), value=self.focus_name(pick))
        algo_out, at = [], 0
        for view in self.algo_views:
            algo_out += self.view_outputs(view, pick, *args[at : at + len(view.inputs)])
            at += len(view.inputs)
        choice, token_choice = args[at:]
        hidden = [view.id for view in self.algo_views if not view.applies(store)]
        hidden += [] if V.has_replay(store) else ["replay"]
        hidden += [] if V.has_ledger(store) else ["ledger"]
        hidden += [] if V.has_staleness(store) else ["staleness"]
        hidden += [] if T.has_traces(store) else ["tokens"]
        hidden += [] if TL.has_timeline(store) else ["timeline"]
        return [
            V.runs_html(stores) if self.catalog.folder is not None else "",
            V.charts_json(stores, pins or []),
            *algo_out,
            V.staleness_figure(store),
            TL.timeline_figure(store),
            TL.timeline_html(store),
            V.replay_html(store),
            V.replay_figure(store),
            V.ledger_html(store),
            *self.picker_outputs(pick, token_choice, T.choices, T.tokens_html),
            *self.picker_outputs(pick, choice, V.sample_choices, V.sample_html),
            V.config_html(store),
            runs,
            focus,
            V.hidden_tabs_css(hidden),
            new_key,
        ]

    def on_load(self, request, *args):
        view = (request.query_params.get("view") if request is not None else None) or "overview"
        selected = view if view in VIEWS or view in {v.id for v in self.algo_views} else "overview"
        sel = [n for n in _query_list(request, "runs") if n in self.catalog.names()]
        pick = {"sel": sel, "focus": (request.query_params.get("focus") if request is not None else None)}
        pins = _query_list(request, "metrics")
        trace = request.query_params.get("trace") if request is not None else None
        if trace:  # ?trace=STEP:ROW: that traced row in the Tokens tab (the last filter is its picker)
            args = (*args[:-1], trace)
        return [self.gr.Tabs(selected=selected), pick, pins, *self.light(pick), *self.heavy("", pick, pins, *args)]

    def picked(self, sel, focus, *args):
        """The runs picker or the shown-run picker changed: the new pick, then every view."""
        pick = {"sel": list(sel or []), "focus": focus}
        return [pick, *self.light(pick), *self.heavy("", pick, *args)]

    # ------------------------------------------------------------------ the page
    def blocks(self):
        with self.gr.Blocks(title=self.title) as demo:
            self.layout()
            self.wire(demo)
        return demo

    def layout(self) -> None:
        """The components, as attributes (their events are :meth:`wire`'s)."""
        gr, folder = self.gr, self.catalog.folder is not None
        gr.HTML(f'<h2 style="margin:0">asyncrl · {V.esc(self.title)}</h2>')
        self.runs_dd = gr.Dropdown(
            self.catalog.names(),
            value=[],
            multiselect=True,
            visible=folder,
            label="runs (none picked: the 8 written to last; all are overlaid in every chart, the "
            "run shown in the cards and the tabs is picked below)",
            elem_id="runs-picker",
        )
        self.focus_dd = gr.Dropdown(
            [],
            value=None,
            visible=folder,
            elem_id="focus-picker",
            label="run shown in the cards, the actors table and the tabs",
        )
        with gr.Tabs(selected="overview") as self.tabs:
            with gr.Tab("Overview", id="overview"):
                self.ov_html = gr.HTML(elem_id="overview")
                self.ov_actors = gr.HTML(elem_id="actors-view")
                self.ov_runs = gr.HTML(elem_id="runs-view")
                self.charts = gr.HTML(
                    value="{}",
                    html_template='<div class="arl-charts" id="charts"></div>',
                    js_on_load=V.CHARTS_JS,
                    elem_id="charts-view",
                )
            self.algo_boxes = []  # per algorithm view: its note and its column
            for view in self.algo_views:
                with gr.Tab(view.title, id=view.id):
                    box_note = gr.HTML()
                    with gr.Column(visible=False) as box:
                        view.build(gr, self.empty)
                    self.algo_boxes.append((box_note, box))
            self._generic_tabs()
        # the tabs that do not apply to the shown run, hidden by a style rule (Gradio 6.31 draws a tab's
        # button whatever its visible=)
        self.tab_style = gr.HTML("", elem_id="tab-style", padding=False, container=False)
        self.rev, self.pins, self.pick = gr.State(""), gr.State([]), gr.State({"sel": [], "focus": None})
        algo_out = [c for view, box in zip(self.algo_views, self.algo_boxes) for c in (*box, *view.outputs)]
        self.heavy_out = [
            self.ov_runs,
            self.charts,
            *algo_out,
            self.st_plot,
            self.tl_plot,
            self.tl_html,
            self.rp_html,
            self.rp_plot,
            self.ld_html,
            self.tk_choice,
            self.tk_html,
            self.sm_choice,
            self.sm_html,
            self.cfg_html,
            self.runs_dd,
            self.focus_dd,
            self.tab_style,
            self.rev,
        ]

    def _generic_tabs(self) -> None:
        """The tabs every run may have (each hidden where it does not apply: :meth:`heavy`), after the
        algorithms' own."""
        gr = self.gr
        with gr.Tab("Staleness", id="staleness"):
            self.st_plot = gr.Plot(show_label=False, format="png", elem_id="staleness-plot")
        with gr.Tab("Timeline", id="timeline"):
            self.tl_plot = gr.Plot(show_label=False, format="png", elem_id="timeline-plot")
            self.tl_html = gr.HTML(elem_id="timeline-tab")
        with gr.Tab("Replay buffer", id="replay"):
            self.rp_html = gr.HTML(elem_id="replay-view")
            self.rp_plot = gr.Plot(show_label=False, format="png", elem_id="replay-plot")
        with gr.Tab("Task ledger", id="ledger"):
            self.ld_html = gr.HTML(elem_id="ledger-view")
        with gr.Tab("Tokens", id="tokens"):
            self.tk_choice = gr.Dropdown(choices=[], label="traced row (newest step first)", elem_id="token-picker")
            self.tk_html = gr.HTML(elem_id="tokens-view")
        with gr.Tab("Samples", id="samples"):
            self.sm_choice = gr.Dropdown(choices=[], label="sample (newest first)")
            self.sm_html = gr.HTML(elem_id="samples-view")
        with gr.Tab("Config", id="config"):
            self.cfg_html = gr.HTML(elem_id="config-tab")

    def wire(self, demo) -> None:
        """The page's events: the first load, the two timers, the pickers, the views' own inputs."""
        gr, cards = self.gr, [self.ov_html, self.ov_actors]
        filters = [c for view in self.algo_views for c in view.inputs] + [self.sm_choice, self.tk_choice]

        def on_load(request: gr.Request, *args):  # (Gradio passes the request by this annotation)
            return self.on_load(request, *args)

        # the first data comes with the page load (not over the queue)
        demo.load(
            on_load,
            inputs=filters,
            outputs=[self.tabs, self.pick, self.pins, *cards, *self.heavy_out],
            queue=False,
            show_progress="hidden",
        )
        gr.Timer(2.0).tick(self.light, inputs=[self.pick], outputs=cards, show_progress="hidden")
        gr.Timer(5.0).tick(
            self.heavy,
            inputs=[self.rev, self.pick, self.pins, *filters],
            outputs=self.heavy_out,
            show_progress="hidden",
        )
        for picker in (self.runs_dd, self.focus_dd):
            picker.input(
                self.picked,
                inputs=[self.runs_dd, self.focus_dd, self.pins, *filters],
                outputs=[self.pick, *cards, *self.heavy_out],
                show_progress="hidden",
            )
        for view, box in zip(self.algo_views, self.algo_boxes):
            for c in view.inputs:
                c.change(
                    functools.partial(self.view_outputs, view),
                    inputs=[self.pick, *view.inputs],
                    outputs=[*box, *view.outputs],
                    show_progress="hidden",
                )
            view.wire(gr, self.main_store, self.pick)
        self.sm_choice.input(
            lambda p, c: V.sample_html(self.main_store(p), c),
            inputs=[self.pick, self.sm_choice],
            outputs=[self.sm_html],
        )
        self.tk_choice.input(
            lambda p, c: T.tokens_html(self.main_store(p), c),
            inputs=[self.pick, self.tk_choice],
            outputs=[self.tk_html],
        )
