"""The command-line options of the UI, defined once: ``asyncrl ui`` (:mod:`asyncrl.commands.cli`) and
``python -m asyncrl.app.main`` both build their parser with :func:`add_ui_arguments`."""

from __future__ import annotations

import argparse


def add_ui_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--run", help="run directory (runs/<name>), followed while it is written")
    p.add_argument(
        "--connect",
        help="a live learner's events address ('events' in <run>/addresses.json: "
        "ipc://PATH on its host, tcp://HOST:PORT with CURVE keys)",
    )
    p.add_argument("--curve-dir", help="CURVE keys (asyncrl keys) when the learner uses wire.curve_dir")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default loopback)")
    p.add_argument("--port", type=int, default=7860, help="port (0: any free port)")
    p.add_argument(
        "--auth",
        help="user:password (required for a non-loopback --host); failed logins are limited per client (5 a minute)",
    )
    p.add_argument(
        "--tls-cert",
        help="serve HTTPS with this PEM certificate (with --tls-key); without it "
        "the UI is plain HTTP: off loopback, use this or an SSH tunnel",
    )
    p.add_argument("--tls-key", help="the certificate's PEM private key")
    return p


def parse_ui_args(argv: list[str]) -> argparse.Namespace:
    """``python -m asyncrl.app.main ARGS``: the options of ``asyncrl ui``."""
    return add_ui_arguments(argparse.ArgumentParser(prog="asyncrl ui")).parse_args(argv)
