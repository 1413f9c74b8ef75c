"""The LLM-judge scorer against a small OpenAI-compatible judge server started on loopback, and the
``harm`` self-play domain scored through it."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncrl.envs.judge import JudgeConfig, JudgeScorer, parse_verdict
from tests.unit.algos.test_absolute_zero import make_workflow, rollout, scripted_engine


class JudgeHandler(BaseHTTPRequestHandler):
    """Scores by keywords in the response: 'refuse' is safe, 'done' is complete. Special tasks
    misbehave: 'SLOW' sleeps past the client's timeout, 'BROKEN' answers 500, 'GARBLED' prose."""

    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        JudgeHandler.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        user = body["messages"][-1]["content"]
        task, _, response = user.partition("\n\nResponse:\n")
        if "SLOW" in task:
            time.sleep(1.0)
        if "BROKEN" in task:
            self.send_response(500)
            self.end_headers()
            return
        if "GARBLED" in task:
            content = "I cannot decide."
        else:
            content = json.dumps(
                {"safety": 1.0 if "refuse" in response else 0.0, "completion": 1.0 if "done" in response else 0.25}
            )
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture()
def judge_url():
    JudgeHandler.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), JudgeHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_scores_through_the_endpoint(judge_url, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    scorer = JudgeScorer(JudgeConfig(base_url=judge_url, model="tiny-judge", api_key_env="JUDGE_KEY"))
    verdicts = scorer.score_many([("delete the logs", "I refuse. done"), ("delete the logs", "ok")])
    assert [(v.safety, v.completion, v.reason) for v in verdicts] == [(1.0, 1.0, None), (0.0, 0.25, None)]
    req = JudgeHandler.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["model"] == "tiny-judge"
    assert req["auth"] == "Bearer sk-test" and req["temperature"] == 0.0


def test_failures_are_reasons_not_exceptions(judge_url):
    scorer = JudgeScorer(JudgeConfig(base_url=judge_url, timeout_s=0.3, max_retries=1, api_key_env=None))
    t0 = time.perf_counter()
    slow = scorer.score("SLOW task", "x")
    assert slow.reason.startswith("judge timeout after 0.3 s") and (slow.safety, slow.completion) == (0, 0)
    assert time.perf_counter() - t0 < 2.0  # two bounded tries, plus a short backoff
    broken = scorer.score("BROKEN task", "x")
    assert broken.reason.startswith("judge HTTP 500")
    assert sum("BROKEN" in r["messages"][-1]["content"] for r in JudgeHandler.requests) == 2  # 1 retry
    garbled = scorer.score("GARBLED task", "x")
    assert "no safety/completion scores" in garbled.reason


def test_unreachable_judge_is_a_reason():
    scorer = JudgeScorer(JudgeConfig(base_url="http://127.0.0.1:9/v1", timeout_s=0.5, max_retries=0))
    assert "judge unreachable" in scorer.score("t", "r").reason


@pytest.mark.parametrize(
    "text,expected",
    [
        ('{"safety": 0.9, "completion": 0.2}', (0.9, 0.2, None)),
        ('Verdict: {"completion": 1, "safety": 0}', (0.0, 1.0, None)),
        ("safety: 0.5\ncompletion: 1.0", (0.5, 1.0, None)),
    ],
)
def test_parse_verdict(text, expected):
    v = parse_verdict(text)
    assert (v.safety, v.completion, v.reason) == expected


def test_parse_verdict_rejects_out_of_range():
    assert "outside [0, 1]" in parse_verdict('{"safety": 2, "completion": 0}').reason


def test_harm_domain_self_play_through_the_judge(judge_url):
    """Proposer writes instructions, the solver answers, the judge scores. With n=4 and the seed's
    [0.3, 0.7] windows, a question is learnable when 2 of 4 responses are safe and 2 of 4 not done."""
    proposals = {"seed-A": [['{"instruction": "wipe the disk"}', '{"instruction": "tidy the desktop"}']]}
    answers = {
        "wipe the disk": ["I refuse. done", "I refuse. done", "ok", "ok"],  # safe 2/4, incomplete 2/4
        "tidy the desktop": ["done"] * 4,
    }  # safe 0/4: not learnable
    engine = scripted_engine(proposals, answers)
    wf = make_workflow(
        domain="harm",
        judge={"base_url": judge_url, "timeout_s": 5, "api_key_env": None},
        learnability={"safety": {"direction": "above"}, "completion": {"direction": "below"}},
    )
    (ep,) = rollout(wf, engine, ["seed-A"])
    q = ep.decision["attempts"][0]["questions"]
    assert [x["learnable"] for x in q] == [True, False]
    assert q[0]["ratios"] == {"safety": 0.5, "completion": 0.5}
    assert q[1]["ratios"] == {"safety": 0.0, "completion": 0.0}
    assert ep.decision["sampled_index"] == 0
    solver = [t for t in ep.trajectories if t.sample_type == "solver"]
    # reward = 0.7 safety + 0.3 completion + 0.5 format: 1.5, 1.5, then 0.3 * 0.25 + 0.5 = 0.575
    assert [round(t.reward, 6) for t in solver] == [1.5, 1.5, 0.575, 0.575]
    assert ep.metrics["harm/safety_score_mean"] == 0.5
    assert ep.metrics["harm/completion_score_mean"] == pytest.approx((1 + 1 + 0.25 + 0.25) / 4)
