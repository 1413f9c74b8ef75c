"""``asyncrl ui``: a Gradio app on a run directory (``--run``) and/or a live learner's events socket
(``--connect``). Views: Overview, Proposed tasks (Absolute Zero), Confidence trees (RLCR), Replay
buffer, Samples. They update live (``gr.Timer``) without a page reload.

``/?view=overview|tasks|trees|replay|samples`` opens the page on that view (the initial data comes
with the page load, so a headless browser's ``--dump-dom`` sees it).

Bound to 127.0.0.1 by default; any other ``--host`` requires ``--auth user:password``.
"""


import os
import signal
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from asyncrl.wire.sockets import is_loopback  # noqa: E402

VIEWS = ("overview", "tasks", "trees", "replay", "samples")
MAX_EVENTS_PER_KIND = 5000  # the UI keeps the latest events of each kind (metrics: all steps)


class UIError(ValueError):
    """Bad ``asyncrl ui`` arguments, with what to do instead."""


def check_args(args) -> tuple[str, str] | None:
    """Validate the options; returns the ``(user, password)`` pair or None."""
    if not args.run and not args.connect:
        raise UIError("give --run runs/<name> (a run directory) and/or --connect tcp://HOST:PORT "
                      "(a live learner's events address, see <run>/addresses.json)")
    if args.run and not Path(args.run).is_dir():
        raise UIError(f"run directory {args.run} does not exist")
    if args.connect and "://" not in args.connect:
        raise UIError(f"--connect wants a ZeroMQ address such as tcp://127.0.0.1:5555, got {args.connect!r}")
    auth = None
    if args.auth is not None:
        user, sep, password = args.auth.partition(":")
        if not sep or not user or not password:
            raise UIError("--auth must be user:password (both non-empty)")
        auth = (user, password)
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


def build_app(store, live=None, title: str = "asyncrl"):
    """The Gradio Blocks over ``store`` (an :class:`asyncrl.analysis.RunStore`)."""
    import gradio as gr

    from . import views as V

    def live_status():
        return live.status() if live is not None else None

    def light():
        return V.overview_html(store, live_status()), V.actors_html(store)

    def azr_outputs(status, final_only, search):
        present = V.is_azr(store)
        if not present:
            return (V.azr_absent_note(store), gr.update(visible=False), "", gr.update(value=None), [])
        q = V.filter_questions(store.azr_questions(), status or "all", bool(final_only), search or "")
        table, keys = V.questions_table(q)
        return "", gr.update(visible=True), V.azr_groups_html(store), table, keys

    def rlcr_outputs(limit, search):
        if not V.is_rlcr(store):
            return V.rlcr_absent_note(store), gr.update(visible=False), None, ""
        return "", gr.update(visible=True), V.calibration_figure(store), V.trees_html(store, int(limit or 10), search or "")

    def sample_outputs(choice):
        choices = V.sample_choices(store)
        valid = {c[1] for c in choices}
        value = choice if choice in valid else (choices[0][1] if choices else None)
        return gr.update(choices=choices, value=value), V.sample_html(store, value)

    def heavy(rev, status, final_only, search, limit, tsearch, choice):
        if rev == store.revision:
            return [gr.skip()] * 15
        rev = store.revision
        return [V.overview_figure(store), *azr_outputs(status, final_only, search),
                *rlcr_outputs(limit, tsearch), V.replay_html(store), V.replay_figure(store),
                *sample_outputs(choice), rev]

    def on_load(request: gr.Request, status, final_only, search, limit, tsearch, choice):
        view = (request.query_params.get("view") if request is not None else None) or "overview"
        selected = view if view in VIEWS else "overview"
        return [gr.Tabs(selected=selected), *light(), *heavy(-1, status, final_only, search, limit, tsearch, choice)]

    def on_select(keys, evt: gr.SelectData):
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        key = tuple(keys[row]) if keys and row is not None and 0 <= row < len(keys) else None
        return V.question_detail_html(store, key)

    with gr.Blocks(title=title) as demo:
        gr.HTML(f'<h2 style="margin:0">asyncrl · {V.esc(title)}</h2>')
        with gr.Tabs(selected="overview") as tabs:
            with gr.Tab("Overview", id="overview"):
                ov_html = gr.HTML(elem_id="overview")
                ov_actors = gr.HTML(elem_id="actors-view")
                ov_plot = gr.Plot(show_label=False, format="png", elem_id="overview-plot")
            with gr.Tab("Proposed tasks", id="tasks"):
                az_note = gr.HTML()
                with gr.Column(visible=False) as az_col:
                    az_groups = gr.HTML(elem_id="azr-groups-view")
                    with gr.Row():
                        az_status = gr.Dropdown(V.STATUS_FILTERS, value="all", label="questions")
                        az_final = gr.Checkbox(True, label="final attempt of each prompt only")
                        az_search = gr.Textbox(label="search (question, proposal, seed prompt)")
                    az_table = gr.Dataframe(interactive=False, wrap=True, elem_id="azr-questions",
                                            label="Proposed questions (newest first); click one for its responses")
                    az_detail = gr.HTML(V.question_detail_html(store, None), elem_id="azr-detail")
            with gr.Tab("Confidence trees", id="trees"):
                rl_note = gr.HTML()
                with gr.Column(visible=False) as rl_col:
                    rl_plot = gr.Plot(show_label=False, format="png", elem_id="calibration-plot")
                    with gr.Row():
                        rl_limit = gr.Slider(1, 100, value=10, step=1, label="trees shown")
                        rl_search = gr.Textbox(label="search prompts")
                    rl_trees = gr.HTML(elem_id="rlcr-trees")
            with gr.Tab("Replay buffer", id="replay"):
                rp_html = gr.HTML(elem_id="replay-view")
                rp_plot = gr.Plot(show_label=False, format="png", elem_id="replay-plot")
            with gr.Tab("Samples", id="samples"):
                sm_choice = gr.Dropdown(choices=[], label="sample (newest first)")
                sm_html = gr.HTML(elem_id="samples-view")
        keys = gr.State([])
        rev = gr.State(-1)
        filters = [az_status, az_final, az_search, rl_limit, rl_search, sm_choice]
        heavy_out = [ov_plot, az_note, az_col, az_groups, az_table, keys, rl_note, rl_col, rl_plot, rl_trees,
                     rp_html, rp_plot, sm_choice, sm_html, rev]
        # the first data comes with the page load (not over the queue), so --dump-dom sees it
        demo.load(on_load, inputs=filters, outputs=[tabs, ov_html, ov_actors, *heavy_out], queue=False,
                  show_progress="hidden")
        gr.Timer(2.0).tick(light, outputs=[ov_html, ov_actors], show_progress="hidden")
        gr.Timer(5.0).tick(heavy, inputs=[rev, *filters], outputs=heavy_out, show_progress="hidden")
        for c in (az_status, az_final, az_search):
            c.change(azr_outputs, inputs=[az_status, az_final, az_search],
                     outputs=[az_note, az_col, az_groups, az_table, keys], show_progress="hidden")
        az_table.select(on_select, inputs=[keys], outputs=[az_detail])
        for c in (rl_limit, rl_search):
            c.change(rlcr_outputs, inputs=[rl_limit, rl_search], outputs=[rl_note, rl_col, rl_plot, rl_trees],
                     show_progress="hidden")
        sm_choice.input(lambda c: V.sample_html(store, c), inputs=[sm_choice], outputs=[sm_html])
    return demo


def serve(args) -> int:
    from asyncrl.analysis import RunStore

    from .live import DirPoller, EventSubscriber
    from .views import CSS

    auth = check_args(args)
    store = RunStore(max_events_per_kind=MAX_EVENTS_PER_KIND)
    threads = []
    if args.run:
        poller = DirPoller(args.run, store)
        poller.reader.poll()  # the page has data from the first load
        threads.append(poller)
    live = None
    if args.connect:
        live = EventSubscriber(args.connect, store, curve_dir=getattr(args, "curve_dir", None))
        threads.append(live)
    for t in threads:
        t.start()
    title = Path(args.run).resolve().name if args.run else args.connect
    demo = build_app(store, live, title=title)
    port = args.port or free_port(args.host)
    try:
        demo.launch(server_name=args.host, server_port=port, auth=auth, prevent_thread_lock=True, quiet=True,
                    share=False, css=CSS, footer_links=[])
    except OSError as e:
        raise UIError(f"cannot serve on {args.host}:{port} ({e}); pick another --port (0: any free port)") from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{port}/"
    print(f"asyncrl ui: serving {url} "
          f"({'run ' + str(args.run) if args.run else ''}{' + ' if args.run and args.connect else ''}"
          f"{'live events from ' + args.connect if args.connect else ''}); Ctrl-C stops", flush=True)
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
        demo.close()
    return 0


def main(args=None) -> int:
    """Entry point of ``asyncrl ui`` (``args`` from its parser) or ``python -m app.main ARGS``."""
    if args is None or isinstance(args, list):
        from asyncrl.cli import build_parser

        args = build_parser().parse_args(["ui", *(sys.argv[1:] if args is None else args)])
    try:
        return serve(args)
    except (UIError, ValueError, FileNotFoundError) as e:
        print(f"asyncrl ui: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
