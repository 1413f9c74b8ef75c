"""``asyncrl ui``: a real Gradio server on real runs, looked at with headless Chromium; the live
events subscriber over a real ZeroMQ socket; ``asyncrl run --ui``; the bind/auth rules."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import zmq

from asyncrl.analysis import RunStore, load_run
from asyncrl.analysis.ledger import ledger_rows
from asyncrl.app import tokens as T
from asyncrl.wire.codec import encode_msg
from tests.conftest import ROOT, cli, read_jsonl
from tests.support.ui_runs import (
    Browser,
    LineReader,
    make_runs,
    screenshot,
    split_token,
    start_logged,
    start_ui,
    stop,
    ui_in_browser,
    ui_url,
    visible_text,
    wait_dom,
    wait_page,
)


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory, model_cache, tiny_overrides):
    return make_runs(tmp_path_factory, model_cache)


def _version(dom: str) -> int:
    m = re.search(r'id="policy-version">(\d+)<', dom)
    return int(m.group(1)) if m else -1


@pytest.mark.slow
def test_ui_pages_show_both_runs_in_headless_chromium(demo_runs, tmp_path):
    azr_dir, rlcr_dir = demo_runs["absolute_zero"], demo_runs["rlcr"]
    azr, rlcr = load_run(azr_dir), load_run(rlcr_dir)
    procs = [start_ui("--run", str(azr_dir)), start_ui("--run", str(rlcr_dir))]
    profile = tmp_path / "chromium"
    try:
        azr_url, rlcr_url = (ui_url(reader) for _, reader in procs)

        # Overview: the learner's policy version and the actor list
        dom = wait_dom(
            azr_url + "?view=overview",
            profile,
            lambda d: _version(d) > 0 and 'class="arl-chart-svg"' in d and "finished" in visible_text(d),
            what="a policy version, the curves and the run's state",
            screenshot_name="ui-overview.png",
        )
        assert _version(dom) == azr.version == 3
        text = visible_text(dom)
        assert "actor-0" in text and "absolute_zero" in text and "finished" in text
        assert 'id="advice"' in dom and "What to change" in text  # (issue 67: the verdict and its numbers)
        assert dom.count('class="arl-chart"') >= 10  # every metric its own chart

        # Proposed tasks: one group row per logged prompt, the questions table, the kept questions
        dom = wait_dom(
            azr_url + "?view=tasks",
            profile,
            lambda d: 'id="azr-groups"' in d,
            what="question groups",
            screenshot_name="ui-tasks.png",
        )
        groups = azr.table("azr_groups")
        table = dom[dom.index('id="azr-groups"') :]
        table = table[: table.index("</table>")]
        assert table.count('class="arl-row"') == len(groups) == 12
        text = visible_text(dom)
        for prompt in groups["seed_prompt"]:
            assert prompt in text
        kept = groups[groups["kept"]]
        assert len(kept) and all(q in text for q in kept["sampled_question"])
        assert "LEARNABLE" in text and "sampled" in text  # the questions table's flags
        assert "does not use Absolute Zero" not in text

        # an Absolute Zero run has no confidence trees, and says so
        dom = wait_dom(
            azr_url + "?view=trees", profile, lambda d: "does not use RLCR" in visible_text(d), what="the RLCR note"
        )
        assert 'class="arl-tree rlcr-tree"' not in dom

        # Confidence trees: every logged tree with its answers and confidences, a reliability diagram
        dom = wait_dom(
            rlcr_url + "?view=trees",
            profile,
            lambda d: "rlcr-tree" in d and "data:image/png" in d[d.find('id="calibration-plot"') :],
            what="confidence trees and the reliability diagram",
            screenshot_name="ui-trees.png",
        )
        nodes = rlcr.table("rlcr_nodes")
        assert dom.count('class="arl-tree rlcr-tree"') == nodes["episode_id"].nunique() == 6
        assert dom.count('class="rlcr-confidence"') == len(nodes) == 6 * 2 * 2
        text = visible_text(dom)
        for prompt in nodes["prompt"].unique():
            assert prompt in text
        assert "Brier reward" in text and "advantage" in text
        assert 'id="calibration-plot"' in dom and "data:image/png" in dom

        # Staleness (issue 67): per step, the trained tokens by version lag; what the bound cut; episodes by lag
        dom = wait_dom(
            rlcr_url + "?view=staleness",
            profile,
            lambda d: d.find('id="staleness-plot"') >= 0 and "data:image/png" in d[d.find('id="staleness-plot"') :],
            what="the staleness figure",
            screenshot_name="ui-staleness.png",
        )

        # Task ledger (issue 66): the run's epochs as asyncrl ledger prints them, and the exactly-once verdict
        dom = wait_dom(
            rlcr_url + "?view=ledger",
            profile,
            lambda d: 'id="ledger-table"' in d,
            what="the task ledger",
            screenshot_name="ui-ledger.png",
        )
        rows, _, ok = ledger_rows(rlcr_dir)
        table = dom[dom.index('id="ledger-table"') :]
        table = table[: table.index("</table>")]
        assert ok and rows and table.count("<tr") == len(rows) + 1  # (the header row)
        assert "exactly once: every task trained at most once per epoch" in visible_text(dom)

        # Tokens (issue 67): a traced row token by token, coloured by version, with what the loss saw;
        # every role of Absolute Zero and both levels of RLCR are among the traced rows
        for url, store, kinds, shot in (
            (azr_url, azr, {"Absolute Zero proposer", "Absolute Zero solver"}, None),
            (rlcr_url, rlcr, {"RLCR answer level", "RLCR confidence level"}, "ui-tokens.png"),
        ):
            dom = wait_dom(
                url + "?view=tokens",
                profile,
                lambda d: 'id="token-trace"' in d and 'id="token-trace-table"' in d,
                what="a traced row",
                screenshot_name=shot,
            )
            traces = store.records("token_trace")
            assert traces and all(t["rows"] for t in traces)
            row = traces[-1]["rows"][0]
            assert dom.count("data-role=") == len(row["tokens"])  # every token of the newest step's first row
            text = visible_text(dom)
            assert f"Step {traces[-1]['step']}, traced row 1 of {len(traces[-1]['rows'])}" in text
            assert "learner logp" in text and "IS weight" in text and "trained by version" in text
            labels = {T._label(r) for t in traces for r in t["rows"]}
            assert kinds <= labels, labels

        # Timeline (issue 67): a lane for the learner and each actor, and the shares of their states
        dom = wait_dom(
            rlcr_url + "?view=timeline",
            profile,
            lambda d: 'id="timeline-table"' in d and "data:image/png" in d[d.find('id="timeline-plot"') :],
            what="the process timeline",
            screenshot_name="ui-timeline.png",
        )
        table = dom[dom.index('id="timeline-table"') :]
        table = visible_text(table[: table.index("</table>")])
        assert (
            "learner" in table and "actor-0" in table and "training" in table
        )  # (a 3-step run: one or two heartbeats)

        # Samples: the per-token view of the latest sample event
        dom = wait_dom(rlcr_url + "?view=samples", profile, lambda d: 'id="sample-view"' in d, what="a sample")
        sample = rlcr.records("sample")[-1]
        assert dom.count('class="arl-tok"') >= len(sample["tokens"])
        assert f"Step {sample['step']}: {sample['sample_type']} trajectory" in visible_text(dom)
    finally:
        for proc, _ in procs:
            stop(proc)
    assert all(proc.returncode == 0 for proc, _ in procs)


CHART_JS = """(() => {{
  const c = document.querySelector('.arl-chart[data-metric="{metric}"]');
  if (!c) return null;
  c.scrollIntoView({{block: 'center'}});  // mouse events take viewport coordinates
  const r = c.querySelector('svg').getBoundingClientRect();
  return {{y: [...c.querySelectorAll('.arl-yaxis text')].map(t => t.textContent),
          x: [...c.querySelectorAll('.arl-xaxis text')].map(t => t.textContent),
          runs: [...c.querySelectorAll('polyline.arl-line')].map(p => p.dataset.run),
          tip: c.querySelector('.arl-tip').style.display === 'none' ? null : c.querySelector('.arl-tip').textContent,
          left: r.left, top: r.top, width: r.width, height: r.height}};
}})()"""


def _folder_of(demo_runs: dict, tmp_path):
    """A folder of runs holding the Absolute Zero and RLCR demo runs (links)."""
    folder = tmp_path / "runs"
    folder.mkdir()
    for alg in ("absolute_zero", "rlcr"):
        (folder / alg).symlink_to(demo_runs[alg], target_is_directory=True)
    return folder


def _chart(browser: Browser, metric: str) -> dict:
    c = browser.js(CHART_JS.format(metric=metric))
    assert c is not None, f"no chart of {metric}"
    return c


@pytest.mark.slow
def test_charts_have_their_own_axes_overlay_two_runs_on_wall_time_hover_and_zoom(demo_runs, tmp_path):
    """Issue 29 items 1 and 2 in a real browser: every metric its own chart with its own y axis;
    both runs of a folder overlaid by default; x switched to wall time; hovering shows both runs'
    values; dragging zooms every chart, a double-click zooms out; smoothing shows the raw value too."""
    folder = _folder_of(demo_runs, tmp_path)
    with ui_in_browser(folder, tmp_path / "chromium", "?view=overview") as browser:
        wait_page(
            browser,
            lambda d: all(f'data-metric="{m}"' in d for m in ("entropy", "tokens_per_s", "grad_norm")),
            what="the entropy, tokens/s and gradient-norm charts",
        )
        entropy, tps = _chart(browser, "entropy"), _chart(browser, "tokens_per_s")
        assert sorted(entropy["runs"]) == sorted(tps["runs"]) == ["absolute_zero", "rlcr"]  # overlaid by default
        ent_ticks, tps_ticks = ([float(v) for v in c["y"]] for c in (entropy, tps))
        assert max(ent_ticks) < 20 < 100 < max(tps_ticks)  # each its own y axis, not one for all
        assert entropy["x"][-1] == "step"

        browser.js(
            "(() => { const s = document.querySelector('select.arl-x'); s.value = 'time';"
            " s.dispatchEvent(new Event('change')); })()"
        )
        entropy = _chart(browser, "entropy")
        assert entropy["x"][-1] == "wall time" and all(t.endswith(" s") for t in entropy["x"][:-1])
        assert sorted(entropy["runs"]) == ["absolute_zero", "rlcr"]

        cx, cy = entropy["left"] + entropy["width"] * 0.6, entropy["top"] + entropy["height"] * 0.4
        browser.mouse("mouseMoved", cx, cy)
        tip = _chart(browser, "entropy")["tip"]
        assert tip and "absolute_zero:" in tip and "rlcr:" in tip and "at wall time" in tip, tip
        screenshot(browser, "ui-charts.png")

        # another chart with a point at every step (tokens_per_s of a 3-step run can span less than the
        # 0.1 s its tick labels show, so its labels may not change when it zooms)
        x_before = _chart(browser, "grad_norm")["x"]
        left, right = entropy["left"] + entropy["width"] * 0.35, entropy["left"] + entropy["width"] * 0.8
        browser.mouse("mousePressed", left, cy, clicks=1)
        browser.mouse("mouseMoved", right, cy)
        browser.mouse("mouseReleased", right, cy, clicks=1)
        state = browser.js("document.querySelector('.arl-charts-state').textContent")
        assert state.startswith("zoomed to wall time"), state
        assert _chart(browser, "grad_norm")["x"] != x_before  # every chart zoomed, not only this one
        e = _chart(browser, "entropy")
        browser.mouse("mousePressed", e["left"] + 100, e["top"] + 50, clicks=1)
        browser.mouse("mouseReleased", e["left"] + 100, e["top"] + 50, clicks=1)
        browser.mouse("mousePressed", e["left"] + 100, e["top"] + 50, clicks=2)
        browser.mouse("mouseReleased", e["left"] + 100, e["top"] + 50, clicks=2)
        assert _chart(browser, "grad_norm")["x"] == x_before

        browser.js(
            "(() => { const s = document.querySelector('input.arl-smooth'); s.value = '0.6';"
            " s.dispatchEvent(new Event('input')); })()"
        )
        e = _chart(browser, "entropy")
        browser.mouse("mouseMoved", e["left"] + e["width"] * 0.6, e["top"] + e["height"] * 0.4)
        assert "(raw " in _chart(browser, "entropy")["tip"]

        browser.js(
            "(() => { const s = document.querySelector('input.arl-filter'); s.value = 'tokens_per';"
            " s.dispatchEvent(new Event('input')); })()"
        )
        shown = browser.js("[...document.querySelectorAll('.arl-chart')].map(c => c.dataset.metric)")
        assert sorted(shown) == ["learner/tokens_per_s", "tokens_per_s"]  # every metric whose name has it


@pytest.mark.slow
def test_run_with_ui_serves_the_live_run_and_stops_with_it(tmp_path, tiny_overrides):
    overrides = [
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=live",
        "train.total_steps=100000",
        "train.batch_tasks=2",
        "actor.tasks_per_batch=2",
        "sampling.n=2",
        "eval.size=4",
        "eval.every=0",
        "log.progress=false",
        "checkpoint.every=0",
        "actor.heartbeat_s=0.5",
        "log.sample_every=2",
    ]
    proc, reader = start_logged(cli("run", "-c", str(ROOT / "configs" / "quickstart.yaml"), "--ui", *overrides))
    profile = tmp_path / "chromium"
    try:
        announced = reader.wait_for(r"\[asyncrl\] UI at (http://127\.0\.0\.1:(\d+)/\?token=\S+)").group(1)
        # 64.6: the URL is printed once the UI accepts connections (it was printed ~25 s before)
        socket.create_connection(("127.0.0.1", int(re.search(r":(\d+)/", announced).group(1))), timeout=5).close()
        served = reader.wait_for(r"asyncrl ui: serving (http://\S+) \(run .* \+ live events from ipc://").group(1)
        assert served == announced  # (the token run made is the one the UI serves with)
        served = split_token(served)
        dom = wait_dom(
            served + "?view=overview",
            profile,
            lambda d: _version(d) >= 2 and re.search(r"live events from .*?: [1-9]\d* received", visible_text(d)),
            what="a live policy version >= 2 and received events",
            screenshot_name="ui-live.png",
        )
        assert "finished" not in visible_text(dom)
        # the live run's traced rows and timeline (issue 67), as they come
        dom = wait_dom(
            served + "?view=tokens",
            profile,
            lambda d: 'id="token-trace-table"' in d,
            what="a traced row of the live run",
        )
        assert "trained by version" in visible_text(dom)
        dom = wait_dom(
            served + "?view=timeline",
            profile,
            lambda d: 'id="timeline-table"' in d and "actor-0" in visible_text(d) and "generating" in visible_text(d),
            what="the live run's timeline with the actor generating",
            screenshot_name="ui-timeline-live.png",
        )
        assert "learner" in visible_text(dom) and "training" in visible_text(dom)
    finally:
        code = stop(proc, signal.SIGINT, timeout=120)
    assert code == 130, "".join(reader.lines)[-3000:]
    port = int(re.search(r":(\d+)/", announced).group(1))
    with socket.socket() as s:  # the UI stopped with the run
        assert s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_ui_with_auth_requires_a_login(demo_runs):
    proc, reader = start_ui("--run", str(demo_runs["absolute_zero"]), "--auth", "alice:s3cret")
    try:
        url = ui_url(reader)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "config", timeout=30)
        assert err.value.code == 401
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        bad = urllib.parse.urlencode({"username": "alice", "password": "wrong"}).encode()
        with pytest.raises(urllib.error.HTTPError):
            opener.open(url + "login", data=bad, timeout=30)
        good = urllib.parse.urlencode({"username": "alice", "password": "s3cret"}).encode()
        assert opener.open(url + "login", data=good, timeout=30).status == 200
        assert opener.open(url + "config", timeout=30).status == 200
    finally:
        stop(proc)


@pytest.mark.slow
def test_ui_on_loopback_serves_only_with_its_token(demo_runs):
    """41: every local user reaches 127.0.0.1, so without --auth the UI makes a token and serves only
    requests that carry it: the printed URL's ``?token=`` once, then the cookie it sets."""
    proc, reader = start_ui("--run", str(demo_runs["absolute_zero"]))
    try:
        printed = reader.wait_for(r"asyncrl ui: serving (http://\S+)").group(1)
        base, token = printed.split("?token=")
        assert len(token) >= 32
        for url in (base, base + "config", base + "?view=overview", base + "?token=" + "x" * len(token)):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(url, timeout=30)
            assert err.value.code == 401 and b"token" in err.value.read()
        jar = urllib.request.HTTPCookieProcessor()
        opener = urllib.request.build_opener(jar)
        assert opener.open(printed, timeout=30).status == 200
        port = int(re.search(r":(\d+)/", base).group(1))
        cookie = next(c for c in jar.cookiejar if c.name == f"asyncrl_ui_{port}")
        assert cookie.value == token and cookie.has_nonstandard_attr("HttpOnly")
        assert opener.open(base + "config", timeout=30).status == 200  # the cookie alone now
    finally:
        stop(proc)


def _login(url: str, password: str, source: str = "127.0.0.1") -> int:
    """POST a login from ``source`` (another loopback address is another client); its status."""
    import http.client

    host, port = re.match(r"https?://([^:/]+):(\d+)/", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=30, source_address=(source, 0))
    try:
        conn.request(
            "POST",
            "/login",
            urllib.parse.urlencode({"username": "alice", "password": password}),
            {"Content-Type": "application/x-www-form-urlencoded"},
        )
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.slow
def test_failed_logins_are_limited_per_client(demo_runs):
    """25.7: 50 wrong logins in 1.17 s were all answered. After 5 failures a minute a client is
    answered 429 without a check (its right password too); another client is not held up."""
    proc, reader = start_ui("--run", str(demo_runs["absolute_zero"]), "--auth", "alice:s3cret")
    try:
        url = ui_url(reader)
        codes = [_login(url, f"guess{i}") for i in range(50)]
        assert codes[:5] == [400] * 5 and set(codes[5:]) == {429}, codes
        assert _login(url, "s3cret") == 429  # refused unchecked while the client is held back
        assert _login(url, "s3cret", source="127.0.0.2") == 200  # another client logs in
    finally:
        stop(proc)


@pytest.mark.slow
def test_the_ui_serves_tls_when_given_a_certificate(demo_runs, tmp_path):
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    proc, reader = start_ui(
        "--run",
        str(demo_runs["absolute_zero"]),
        "--auth",
        "alice:s3cret",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    )
    try:
        url = reader.wait_for(r"asyncrl ui: serving (https://\S+)").group(1)
        ctx = ssl.create_default_context(cafile=str(cert))
        ctx.check_hostname = False
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "config", timeout=30, context=ctx)
        assert err.value.code == 401  # served over TLS, still behind the login
    finally:
        stop(proc)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--host", "0.0.0.0"], "requires --auth user:password"),
        (["--host", "192.168.1.5", "--auth", "nocolon"], "--auth must be user:password"),
        (["--auth", "user:"], "--auth must be user:password"),
        (["--connect", "127.0.0.1:5555"], "wants a ZeroMQ address"),
        (["--port", "70000"], "--port must be in 0..65535"),
    ],
)
def test_ui_rejects_bad_options_with_a_clear_error(tmp_path, capsys, args, message):
    from asyncrl.app.main import main

    assert main(["--run", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_ui_needs_a_run_or_an_address(tmp_path, capsys):
    from asyncrl.app.main import main

    assert main([]) == 2
    assert "give --run" in capsys.readouterr().err
    assert main(["--run", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_event_subscriber_decodes_the_learner_event_stream():
    from asyncrl.app.live import EventSubscriber

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    store = RunStore()
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", store)
    sub.start()
    status = {"schema": 1, "kind": "actor_status", "t": 1.0, "step": 4, "actor_id": "actor-7", "version": 3}
    metrics = {"schema": 1, "kind": "metrics", "t": 2.0, "step": 5, "metrics": {"version": 5, "loss": 0.25}}
    try:
        deadline = time.time() + 30
        while time.time() < deadline and not (store.records("actor_status") and len(store.metrics)):
            # PUB drops messages until the subscription has arrived: keep sending (de-duplicated)
            pub.send_multipart(encode_msg("event", event=status))
            pub.send_multipart(encode_msg("event", event=metrics))
            pub.send_multipart([b"\x93not a header"])
            pub.send_multipart(encode_msg("hello", actor_id="x", capacity=1))  # not an event
            time.sleep(0.1)
        assert store.records("actor_status") == [status]  # once, however often it was received
        assert store.metrics.loc[5, "loss"] == 0.25 and store.version == 5
        assert sub.received >= 2 and sub.bad >= 2
        assert "actor-7" in store.actors(now=2.0)["actor_id"].tolist()
    finally:
        sub.stop()
        sub.join(timeout=10)
        pub.close(0)
    assert not sub.is_alive()


@pytest.mark.slow
def test_views_question_detail_filters_and_absent_algorithms(demo_runs):
    from asyncrl.algos.absolute_zero import ui as A
    from asyncrl.app import views as V

    azr = load_run(demo_runs["absolute_zero"])
    q = azr.table("azr_questions")
    learnable = A.filter_questions(q, "learnable")
    assert len(learnable) and learnable["learnable"].all() and learnable["final"].all()
    assert A.filter_questions(q, "invalid")["valid"].sum() == 0
    assert len(A.filter_questions(q, "all", final_only=False)) == min(len(q), A.MAX_QUESTION_ROWS)
    with pytest.raises(ValueError, match="unknown status filter"):
        A.filter_questions(q, "bogus")
    table, keys = A.questions_table(A.filter_questions(q, "sampled"))
    assert len(table) == len(keys) == azr.table("azr_groups")["kept"].sum()
    detail = A.question_detail_html(azr, keys[0])
    row = q[(q["episode_id"] == keys[0][0]) & (q["attempt"] == keys[0][1]) & (q["index"] == keys[0][2])].iloc[0]
    assert 'id="solver-responses"' in detail and detail.count("arl-row") >= len(row["responses"])
    assert "sampled for training" in detail
    # the app's click handler: a row of the questions table -> that question's responses
    import gradio as gr

    from asyncrl.app.main import build_app

    handlers = {f.name: f.fn for f in build_app(azr).fns.values()}
    clicked = handlers["on_select"](keys, gr.SelectData(None, {"index": [0, 4], "value": ""}))
    assert clicked == detail
    assert "Click a question" in handlers["on_select"]([], gr.SelectData(None, {"index": [0, 0], "value": ""}))
    # the algorithms' own tabs, found through their workflows; each says so on another algorithm's run
    views = {v.id: v for v in V.algorithm_views()}
    assert {"tasks", "trees"} <= set(views)
    assert "does not use RLCR" in views["trees"].absent_note(azr)
    rlcr = load_run(demo_runs["rlcr"])
    assert not views["tasks"].applies(rlcr) and views["trees"].applies(rlcr)
    assert "does not use Absolute Zero" in views["tasks"].absent_note(rlcr)
    assert "no per-token samples" in V.sample_html(RunStore(), None)
    first = rlcr.records("sample")[0]
    html = V.sample_html(rlcr, 0)
    assert f"Step {first['step']}:" in html and html.count('class="arl-tok"') == len(first["tokens"]) + 3  # + legend
    assert html.count("arl-row") == sum(1 for m, e in zip(first["loss_mask"], first["exp_mask"]) if m or e)
    assert "has no experience replay" in V.replay_html(rlcr)


def test_replay_view_shows_replay_state_and_metrics_when_present():
    from asyncrl.app import views as V

    store = RunStore()
    store.add_metrics(
        [
            {
                "step": s,
                "t": float(s),
                "version": s,
                "buffer_size": 3 + s,
                "replay/pool_tasks": 10 * s,
                "replay/skip_tasks": s,
                "replay/pool_trajectories": 40 * s,
                "replay/replayed_share": 0.25,
                "replay/active": 1,
            }
            for s in (1, 2)
        ]
    )
    store.add_events(
        [
            {
                "schema": 1,
                "kind": "replay_state",
                "t": 2.0,
                "step": 2,
                "buckets": {"0": 4, "1": 2, "8": 1},
                "pool_tasks": 20,
                "skip_tasks": 2,
                "pool_trajectories": 80,
            }
        ]
    )
    assert V.has_replay(store)
    html = V.replay_html(store)
    assert "no experience replay" not in html
    for label, value in (
        ("buffer size (episodes)", "5"),
        ("pool tasks", "20"),
        ("skip set tasks", "2"),
        ("pool trajectories", "80"),
    ):
        assert f'<div class="k">{label}</div><div class="v">{value}</div>' in html
    fig = V.replay_figure(store)
    bars = [p.get_height() for p in fig.axes[3].patches]
    assert bars == [4, 2, 1]  # the latest buckets, by success count


# ------------------------------------------------------------------------------------- issue 11
_SHOWN_TABS = "[...document.querySelectorAll('[role=tab]')].filter(t => t.offsetParent).map(t => t.textContent.trim())"
_CHART_LABELS = """[...document.querySelectorAll('.arl-chart')].map(c => [c.dataset.metric,
    (c.querySelector('.arl-chart-span') || {}).textContent, (c.querySelector('.arl-ylabel') || {}).textContent])"""


def _check_png_download(browser: Browser, downloads) -> None:
    """The tokens_per_s chart's PNG link in a real browser: a file is downloaded, a PNG of the chart
    (twice its on-screen size), with the chart drawn on it (not a blank white image)."""
    import io

    from PIL import Image

    downloads.mkdir()
    browser.call("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(downloads))
    size = browser.js(
        "(() => { const s = document.querySelector('.arl-chart[data-metric=\"tokens_per_s\"] svg'); "
        "return [+s.getAttribute('width'), +s.getAttribute('height')]; })()"
    )
    browser.js("document.querySelector('.arl-chart[data-metric=\"tokens_per_s\"] a.arl-png').click()")
    out, deadline = downloads / "tokens_per_s.png", time.time() + 120
    while not (out.exists() and out.stat().st_size > 0 and not list(downloads.glob("*.crdownload"))):
        assert time.time() < deadline, f"no PNG downloaded in 120 s: {sorted(p.name for p in downloads.iterdir())}"
        time.sleep(0.2)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    img = Image.open(io.BytesIO(data)).convert("RGB")
    assert list(img.size) == [2 * size[0], 2 * size[1]], (img.size, size)
    colours = img.getcolors(maxcolors=1 << 16) or []
    assert len(colours) > 3, colours  # the lines, axes and labels, not one flat colour


@pytest.mark.slow
def test_the_dashboard_defaults_a_new_user_expects(demo_runs, tmp_path):
    """Issue 42.7 in a real browser 1400 px wide: smoothing 0.6 by default; two charts a row filling
    the width; each chart's unit on its y axis and whether it is per step, cumulative or per
    evaluation; every run of the folder a link; the run shown in the cards and tabs picked by name;
    the tabs that do not apply to it hidden; a wide runs table scrolls inside itself; the Config tab
    leads with what differs from the defaults."""
    folder = _folder_of(demo_runs, tmp_path)
    with ui_in_browser(folder, tmp_path / "chromium", "?view=overview&focus=rlcr") as browser:
        wait_page(
            browser,
            lambda d: 'data-metric="tokens_per_s"' in d and 'id="hidden-tabs"' in d,
            what="the charts and the tab rule",
        )
        assert browser.js("document.querySelector('input.arl-smooth').value") == "0.6"
        grid = browser.js("document.querySelector('.arl-charts-grid').getBoundingClientRect().width")
        widths = browser.js("[...document.querySelectorAll('.arl-chart')].map(c => c.getBoundingClientRect().width)")
        assert grid > 1000 and min(widths) > 0.45 * grid, (grid, widths)  # two a row, the page's width
        labels = {m: (span, unit) for m, span, unit in browser.js(_CHART_LABELS)}
        assert labels["tokens_per_s"] == (" \u00b7 per step", "tokens per second")
        assert labels["train_s"] == (" \u00b7 per step", "seconds")
        assert labels["ingest_s"] == (" \u00b7 cumulative", "seconds")
        shown = browser.js(_SHOWN_TABS)
        assert "Confidence trees" in shown and "Proposed tasks" not in shown and "Replay buffer" not in shown, shown
        assert "rlcr" in browser.js("document.querySelector('#overview-cards').textContent")
        links = browser.js("[...document.querySelectorAll('a.arl-run-link')].map(a => a.textContent)")
        assert sorted(links) == ["absolute_zero", "rlcr"]  # (newest first: the order the runs were written in)
        assert browser.js("document.querySelector('#runs-table').parentElement.className") == "arl-scroll"
        assert browser.js("document.documentElement.scrollWidth <= window.innerWidth")  # nothing runs off the page
        # 64.7: each chart's data as CSV (raw values, every run), and a log y axis
        csv = browser.js(
            'decodeURIComponent(document.querySelector(\'.arl-chart[data-metric="tokens_per_s"] '
            "a.arl-csv').getAttribute('href').split(',').slice(1).join(','))"
        )
        head, *body = csv.splitlines()
        assert (
            head == "run,step,step,tokens_per_s"
            and body
            and {r.split(",")[0] for r in body} <= {"absolute_zero", "rlcr"}
        )
        assert all(float(r.split(",")[3]) > 0 for r in body)
        browser.js("document.querySelector('input.arl-logy').click()")
        wait_page(browser, lambda d: 'data-metric="tokens_per_s" data-logy="1"' in d, what="a log y axis")
        assert browser.js("document.querySelectorAll('.arl-chart a.arl-png').length") >= 2
        _check_png_download(browser, tmp_path / "downloads")
        browser.js("document.querySelector('input.arl-logy').click()")  # (back to linear for what follows)
        screenshot(browser, "ui-dashboard.png")

        base = browser.js("location.origin + location.pathname")
        browser.goto(base + "?view=overview&focus=absolute_zero")
        wait_page(
            browser,
            lambda d: 'id="hidden-tabs"' in d and 'data-tabs="trees,replay"' in d,
            what="the tabs of an Absolute Zero run",
        )
        shown = browser.js(_SHOWN_TABS)
        assert "Proposed tasks" in shown and "Confidence trees" not in shown, shown

        browser.goto(base + "?view=config&focus=absolute_zero")
        wait_page(browser, lambda d: 'id="config-diff"' in d, what="the config's differences")
        diff = browser.js("document.querySelector('#config-diff').textContent")
        full = browser.js("document.querySelectorAll('pre.arl-config')[1].textContent")
        assert "algorithm: absolute_zero  # default grpo" in diff
        assert len(diff.splitlines()) < len(full.splitlines()) / 2  # only what differs, not the whole config
        screenshot(browser, "ui-config.png")


def _tiny_run_args(tmp_path, tiny_overrides, name: str, steps: int, *extra: str) -> list[str]:
    return [
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        f"name={name}",
        f"train.total_steps={steps}",
        "train.batch_tasks=2",
        "actor.tasks_per_batch=2",
        "sampling.n=2",
        "eval.size=4",
        "log.progress=false",
        "checkpoint.every=0",
        "actor.heartbeat_s=0.5",
        *extra,
    ]


@pytest.mark.slow
def test_folder_of_runs_lists_them_and_overlays_picked_runs(demo_runs, tmp_path, tiny_overrides):
    """``asyncrl ui --run <folder of runs>`` lists the runs instead of waiting for one; picked runs
    are overlaid in the metric explorer; the held-out accuracy of a 40-step run is a curve; the
    config is shown."""
    from asyncrl.analysis.demo_runs import demo_run

    folder = tmp_path / "runs"
    folder.mkdir()
    proc, reader = start_ui("--run", str(folder))  # nothing there yet: it says so, and lists runs as they come
    profile = tmp_path / "chromium"
    try:
        url = split_token(
            reader.wait_for(
                r"asyncrl ui: serving (http://\S+) \(folder of runs .*: 0 run\(s\) to "
                r"pick from\)"
            ).group(1)
        )
        dom = wait_dom(url, profile, lambda d: "No runs in" in d, what="the empty folder's note")
        for alg in ("absolute_zero", "rlcr"):
            (folder / alg).symlink_to(demo_runs[alg], target_is_directory=True)
        demo_run(
            "grpo",
            folder,
            name="grpo40",
            steps=40,
            reuse=False,
            quick=True,
            extra_overrides=[tiny_overrides[0], "eval.every=10"],
        )
        dom = wait_dom(url, profile, lambda d: 'id="runs-list"' in d, what="the list of runs")
        text = visible_text(dom)
        assert "3 run(s) in" in text and all(n in text for n in ("absolute_zero", "grpo40", "rlcr"))

        picked = url + "?runs=grpo40,absolute_zero&metrics=reward_mean,eval/accuracy"
        dom = wait_dom(
            picked,
            profile,
            lambda d: _version(d) == 40 and 'data-metric="eval/accuracy"' in d,
            what="the first picked run's version and the pinned charts",
            screenshot_name="ui-compare.png",
        )
        for metric in ("reward_mean", "eval/accuracy"):  # pinned first, both runs overlaid
            chart = dom[dom.index(f'data-metric="{metric}"') :]
            chart = chart[: chart.index("</svg>")]
            assert 'data-run="grpo40"' in chart and 'data-run="absolute_zero"' in chart, metric
        assert dom[dom.index('data-group="') :].startswith('data-group="pinned"')  # the first section
        assert 'id="runs-table"' in dom and "Shown (picked above)" in visible_text(dom)
        assert "finished" in visible_text(dom)

        dom = wait_dom(url + "?view=config&runs=rlcr", profile, lambda d: 'id="config-view"' in d, what="the config")
        text = visible_text(dom)
        assert "config.yaml (the run's first segment)" in text and "algorithm: rlcr" in text
    finally:
        stop(proc)
    assert proc.returncode == 0


@pytest.mark.slow
def test_run_with_ui_keeps_serving_after_training_until_ctrl_c(tmp_path, tiny_overrides):
    """Item 10: the dashboard stays up after the last step; Ctrl-C stops it (exit 0: the training
    succeeded). Item 11: the same run's metrics went to TensorBoard through its own writer."""
    args = _tiny_run_args(
        tmp_path,
        tiny_overrides,
        "done",
        3,
        "eval.every=0",
        "log.trackers=[tensorboard]",
        "env.reward=examples.countdown:reward",
    )  # a reward with named scores
    proc, reader = start_logged(cli(*args, "--ui"))
    profile = tmp_path / "chromium"
    try:
        announced = reader.wait_for(r"\[asyncrl\] UI at (http://127\.0\.0\.1:\d+/\S*)").group(1)
        reader.wait_for(r"\[asyncrl\] training finished; the UI is still serving at " + re.escape(announced))
        announced = split_token(announced)
        dom = wait_dom(
            announced + "?view=overview",
            profile,
            lambda d: "finished" in visible_text(d),
            what="the finished run",
            screenshot_name="ui-after-training.png",
        )
        assert _version(dom) == 3
        time.sleep(1)
        assert proc.poll() is None  # still serving
    finally:
        code = stop(proc, signal.SIGINT, timeout=120)
    assert code == 0, "".join(reader.lines)[-3000:]
    port = int(re.search(r":(\d+)/", announced).group(1))
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "done" / "tensorboard"))
    acc.Reload()
    logged = load_run(tmp_path / "done").metrics
    assert [e.step for e in acc.Scalars("reward/reward_mean")] == [1, 2, 3]
    assert [round(e.value, 5) for e in acc.Scalars("policy/entropy")] == [round(v, 5) for v in logged["entropy"]]
    # item 9: every step has its entropy, response length, no-signal group share and the reward's named scores
    for col in ("entropy", "response_length_mean", "groups/identical_reward_share", "score/format"):
        assert logged[col].notna().all() and len(logged) == 3, col
    assert logged["score/format"].between(0, 1).all()


@pytest.mark.slow
def test_a_killed_learner_shows_as_crashed(tmp_path, tiny_overrides):
    """Item 4: SIGKILL the learner mid-run: no learner_stop, its pid file names a dead process; the
    UI says crashed (not finished)."""
    from tests.conftest import kill_tree

    proc, reader = start_logged(cli(*_tiny_run_args(tmp_path, tiny_overrides, "killed", 100000, "eval.every=0")))
    run_dir = tmp_path / "killed"
    try:
        deadline = time.time() + 180
        while time.time() < deadline and len(read_jsonl(run_dir / "metrics.jsonl")) < 2:
            assert proc.poll() is None, "".join(reader.lines)[-3000:]
            time.sleep(0.5)
        pid = int((run_dir / "learner.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0  # the launcher saw its learner die and stopped the actors
    finally:
        kill_tree(proc)
    from asyncrl.analysis import run_state

    state = run_state(load_run(run_dir))
    assert state.state == "crashed" and f"pid {pid}" in state.reason
    ui, ui_reader = start_ui("--run", str(run_dir))
    profile = tmp_path / "chromium"
    try:
        url = ui_url(ui_reader)
        dom = wait_dom(
            url + "?view=overview",
            profile,
            lambda d: 'class="arl-state-crashed"' in d,
            what="crashed",
            screenshot_name="ui-crashed.png",
        )
        text = visible_text(dom)
        assert "finished" not in text and "no learner_stop event" in text
    finally:
        stop(ui)


@pytest.mark.slow
def test_a_learner_stopped_before_training_prints_no_learning_summary(tmp_path, tiny_overrides):
    """Item 4, the CLI: a learner that trained 0 steps says so and why, and prints no reward or
    accuracy 'change'."""
    from tests.conftest import start_cli

    args = [
        "learn",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={tmp_path}",
        "name=idle",
        "log.progress=false",
        "eval.size=4",
    ]
    proc = start_cli(*args)
    reader = LineReader(proc)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and "learner_start" not in _read(tmp_path / "idle" / "events.jsonl"):
            assert proc.poll() is None, "".join(reader.lines)[-3000:]
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)  # no actor was ever started: nothing can have been trained
        reader.wait_for(r"no learning summary: this run trained 0 steps \(stopped by a stop signal at step 0\)")
        assert proc.wait(timeout=120) == 0
    finally:
        kill_tree_quiet(proc)
    out = "".join(reader.lines)
    assert "asyncrl run summary" not in out and "batch reward" not in out
    from asyncrl.analysis import run_state

    assert run_state(load_run(tmp_path / "idle")).state == "interrupted"


def _read(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def kill_tree_quiet(proc) -> None:
    from tests.conftest import kill_tree

    kill_tree(proc)
