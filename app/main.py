"""``asyncrl ui``: a Gradio app on a run directory (``--run runs/<name>``), a folder of runs to pick
from and overlay (``--run runs/``), and/or a live learner's events socket (``--connect``). Views:
Overview (cards, actors, the runs compared, and every metric its own interactive chart), the tabs the algorithms add (``Workflow.views``: Proposed tasks
for Absolute Zero, Confidence trees for RLCR), Replay buffer, Samples, Config. They update live
(``gr.Timer``) without a page reload.

``/?view=overview|tasks|trees|replay|samples|config`` (a tab's id) opens the page on that view, ``&runs=a,b``
picks runs of a folder (none: the runs written to last), ``&focus=a`` the run the cards, the actors table and
the tabs show (default: the first picked), ``&metrics=x,y`` the metrics charted first (the initial data comes
with the page load, not over the queue). A tab that does not apply to the shown run (an algorithm's tab
for another algorithm, Replay buffer for a run without experience replay) is hidden.

Bound to 127.0.0.1 by default; any other ``--host`` requires ``--auth user:password``. Without
``--auth`` the page is served only with the token in the URL it prints (``?token=...``,
:mod:`app.token_gate`): every local user reaches 127.0.0.1.
"""

import os
import signal
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from asyncrl.schedulers.local import UI_TOKEN_ENV  # noqa: E402
from asyncrl.wire.sockets import is_loopback  # noqa: E402

MAX_EVENTS_PER_KIND = 5000  # the UI keeps the latest events of each kind (metrics: all steps)


class UIError(ValueError):
    """Bad ``asyncrl ui`` arguments, with what to do instead."""


def check_args(args) -> tuple[str, str] | None:
    """Validate the options; returns the ``(user, password)`` pair or None."""
    if not args.run and not args.connect:
        raise UIError(
            "give --run runs/<name> (a run directory) and/or --connect ADDRESS "
            "(a live learner's events address, see <run>/addresses.json)"
        )
    if args.run and not Path(args.run).is_dir():
        raise UIError(f"run directory {args.run} does not exist")
    if args.connect and "://" not in args.connect:
        raise UIError(
            f"--connect wants a ZeroMQ address (the 'events' entry of addresses.json: ipc://PATH, or "
            f"tcp://HOST:PORT with keys), got {args.connect!r}"
        )
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
        raise UIError(
            f"refusing to serve on {args.host!r} without a login: anything but loopback "
            f"(127.0.0.1, ::1, localhost) requires --auth user:password"
        )
    if not 0 <= args.port <= 65535:
        raise UIError(f"--port must be in 0..65535 (0: a free port), got {args.port}")
    return auth


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_app(source, live=None, title: str = "asyncrl"):
    """The Gradio Blocks over ``source``: a :class:`app.live.RunCatalog` (one run or a folder of
    runs) or one :class:`asyncrl.analysis.RunStore` (:class:`app.dashboard.Dashboard` lays it out
    and wires it).

    Query parameters: ``view`` (the tab), ``runs`` (comma-separated run names to pick, folder of
    runs only; none: the runs written to last), ``metrics`` (comma-separated metrics charted first)."""
    from .dashboard import Dashboard
    from .live import RunCatalog

    catalog = source if isinstance(source, RunCatalog) else RunCatalog(source, name=title)
    return Dashboard(catalog, live, title).blocks()


def serve(args) -> int:
    auth = check_args(args)
    catalog, live, threads, folder, title = _sources(args)
    for t in threads:
        t.start()
    demo = build_app(catalog, live, title=title)
    port = args.port or free_port(args.host)
    token = _launch(demo, args, auth, port)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"{'https' if getattr(args, 'tls_cert', None) else 'http'}://{host}:{port}/"
    url += f"?token={token}" if token else ""
    what = (
        f"folder of runs {args.run}: {len(catalog.names())} run(s) to pick from"
        if folder
        else f"{'run ' + str(args.run) if args.run else ''}{' + ' if args.run and args.connect else ''}"
        f"{'live events from ' + args.connect if args.connect else ''}"
    )
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


def _sources(args):
    """What the page shows: ``(catalog, live subscriber or None, threads to start, folder?, title)``."""
    from asyncrl.analysis import RunStore, is_run_dir

    from .live import DirPoller, EventSubscriber, RunCatalog

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
    return catalog, live, threads, folder, title


def _launch(demo, args, auth, port: int) -> str | None:
    """Serve ``demo`` (login limits; without ``auth``, the URL token); returns the token or None."""
    from starlette.middleware import Middleware

    from .login_limit import LoginLimiter
    from .token_gate import TokenGate, new_token
    from .tokens import CSS as TOKENS_CSS
    from .views import CHARTS_CSS, CSS, algorithm_views

    tls = (
        {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key, "ssl_verify": False}  # (its own probe of itself)
        if getattr(args, "tls_cert", None)
        else {}
    )
    middleware = [Middleware(LoginLimiter)]
    token = None
    if auth is None:  # loopback without a login: a token (other local users reach 127.0.0.1 too)
        token = os.environ.pop(UI_TOKEN_ENV, None) or new_token()
        middleware.append(Middleware(TokenGate, token=token))
    try:
        demo.launch(
            server_name=args.host,
            server_port=port,
            auth=auth,
            prevent_thread_lock=True,
            quiet=True,
            share=False,
            css=CSS + CHARTS_CSS + TOKENS_CSS + "".join(v.css for v in algorithm_views()),
            footer_links=[],
            app_kwargs={"middleware": middleware},
            **tls,
        )
    except OSError as e:
        raise UIError(f"cannot serve on {args.host}:{port} ({e}); pick another --port (0: any free port)") from None
    return token


def main(args=None) -> int:
    """Entry point of ``asyncrl ui`` (``args`` from its parser) or ``python -m asyncrl.app.main ARGS``."""
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
