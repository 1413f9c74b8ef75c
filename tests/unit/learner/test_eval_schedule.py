"""64.9: the held-out evaluation's schedule: at the start, then at each multiple of ``eval.every``,
and a resumed run keeps it (it evaluated at 46, 146 and 150 after a resume at 46, not at 100 and 150)."""

from asyncrl.config import load_config
from asyncrl.learner.evaluate import Evaluator
from asyncrl.models.tokenizer import build_char_tokenizer


def _evaluator(every: int) -> Evaluator:
    return Evaluator(load_config(None, [f"eval.every={every}", "eval.size=4"]), build_char_tokenizer())


def _schedule(ev: Evaluator, versions) -> list[int]:
    out = []
    for v in versions:
        if ev.due(v):
            out.append(v)
            ev._last = v  # (what an evaluation records)
    return out


def test_a_fresh_run_evaluates_at_the_start_and_each_multiple():
    assert _schedule(_evaluator(50), range(0, 151)) == [0, 50, 100, 150]


def test_a_resumed_run_keeps_the_schedule():
    ev = _evaluator(100)
    ev.resumed([{"version": 0, "accuracy": 0.5}])  # the run evaluated at 0, then stopped at 46
    assert _schedule(ev, range(46, 151)) == [100]
    assert ev.history == [{"version": 0, "accuracy": 0.5}]
    fresh = _evaluator(100)
    fresh.resumed([])  # a resumed run that never evaluated: its baseline first
    assert _schedule(fresh, range(46, 151)) == [46, 100]
