"""Issue 29 item 7: the advantage each trajectory was trained with is logged (episode and sample
events), every evaluation keeps held-out outputs, and the Completions tab shows a step's groups and
the held-out outputs, searchable, in a real browser."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from asyncrl.analysis import load_run
from asyncrl.app.kit import fmt
from tests.conftest import ROOT, run_cli
from tests.support.ui_runs import screenshot, ui_in_browser, visible_text, wait_page


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_overrides):
    root = tmp_path_factory.mktemp("completions")
    res = run_cli(
        "run",
        "-c",
        str(ROOT / "configs" / "quickstart.yaml"),
        *tiny_overrides,
        f"run_root={root}",
        "name=c",
        "train.total_steps=4",
        "train.batch_tasks=2",
        "actor.tasks_per_batch=2",
        "sampling.n=4",
        "eval.size=6",
        "eval.every=2",
        "log.progress=false",
        "checkpoint.every=0",
        "log.sample_every=1",
        "log.eval_samples=5",
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return root / "c"


@pytest.mark.slow
def test_logged_trajectories_carry_the_advantage_they_were_trained_with(grpo_run):
    run = load_run(grpo_run)
    groups = defaultdict(list)
    for e in run.records("episode"):
        for t in e["trajectories"]:
            groups[(e["step"], t["group_id"])].append((t["reward"], t["advantage"]))
    assert len(groups) == 4 * 2  # every step's groups (log.episode_events=all)
    for rows in groups.values():
        rewards, advs = zip(*rows)
        assert None not in advs
        assert sum(advs) == pytest.approx(0.0, abs=1e-4)  # GRPO: centred within the group
        mean = sum(rewards) / len(rewards)
        assert all((a > 0) == (r > mean) and (a < 0) == (r < mean) for r, a in rows), rows
    samples = run.records("sample")
    assert len(samples) == 4 and all(s["advantage"] is not None for s in samples)
    evals = run.records("eval")
    assert [e["version"] for e in evals] == [0, 2, 4]
    for e in evals:
        assert len(e["samples"]) == 5
        for s in e["samples"]:
            assert s["prompt"].endswith("=") and s["correct"] == (s["reward"] >= 1.0)
            assert isinstance(s["answer"], int) and isinstance(s["completion"], str)


@pytest.mark.slow
def test_the_completions_tab_shows_a_steps_groups_and_held_out_outputs_and_searches(grpo_run, tmp_path):
    run = load_run(grpo_run)
    last = [e for e in run.records("episode") if e["step"] == 4]
    with ui_in_browser(grpo_run, tmp_path / "chromium", "?view=completions") as browser:
        dom = wait_page(
            browser,
            lambda d: 'id="completions-table"' in d and 'id="heldout-table"' in d,
            what="the completions and held-out tables",
        )
        table = dom[dom.index('id="completions-table"') :]
        table = table[: table.index("</table>")]
        assert table.count('class="arl-row"') == sum(len(e["trajectories"]) for e in last) == 8
        shown = re.findall(r'<td><span class="(?:arl-adv-pos|arl-adv-neg|)">([^<]+)</span></td>', table)
        assert shown == [fmt(t["advantage"]) for e in last for t in e["trajectories"]]  # the trained advantages
        text = visible_text(dom)
        assert "Step 4: 2 group(s), 8 completion(s)" in text
        assert "Held-out outputs at policy version 4" in text
        held = dom[dom.index('id="heldout-table"') :]
        assert held[: held.index("</table>")].count('class="arl-row"') == 5
        screenshot(browser, "ui-completions.png")

        browser.js("document.querySelector('#completions-earlier').click()")  # browse to the step before
        dom = wait_page(browser, lambda d: "Step 3: 2 group(s)" in visible_text(d), what="the earlier step")
        assert "logged step 3 of 4 (1 to 4" in visible_text(dom)
        browser.js("document.querySelector('#completions-later').click()")
        wait_page(browser, lambda d: "Step 4: 2 group(s)" in visible_text(d), what="the later step again")

        prompt = last[0]["prompt"]
        prompt = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        browser.js(f"""(() => {{ const t = document.querySelector('#completions-search textarea, #completions-search input');
            t.value = {prompt!r}; t.dispatchEvent(new Event('input', {{bubbles: true}})); }})()""")
        dom = wait_page(browser, lambda d: "logged completion(s) holding" in d, what="the search's results")
        table = dom[dom.index('id="completions-table"') :]
        table = table[: table.index("</table>")]
        want = sum(len(e["trajectories"]) for e in run.records("episode") if prompt in str(e["prompt"]))
        assert table.count('class="arl-row"') == want >= 4
