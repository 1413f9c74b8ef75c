"""Issue 15: one real PolicyTrainer step on 2 gloo processes (DDP and FSDP2) equals one process.

The tiny embedded model, a collated batch of 5 rows (shares of 3 and 2 rows with different token
counts), every ``loss_agg_mode``, a two-mini-batch step and a batch whose rows share their group's
prompt (one copy of it per bin of the packed forward on each rank), the padded forward, micro-batches
of a token budget with the gradients reduced once after the last (a rank with fewer running an empty
one) and rows left out for carrying no gradient (issue 44), LoRA adapters (issue 32), PPO with a critic (issue 46:
values, GAE, the clipped value loss and the critic's own step, full and LoRA), KL and entropy terms on, gradient
clipping off: the gradients averaged over ranks, the parameters after the AdamW step, the gathered
full state dict and the per-row log-probs (``keep_rows``) all match a one-process step within 1e-5;
the metrics combined over ranks match too.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.learner.training import distributed
from asyncrl.learner.training.micro_batches import Totals, loss_scales
from tests.conftest import ROOT, kill_tree, subprocess_env
from tests.support.dist_step_worker import CASES, assert_matches, one_step

WORKER = ROOT / "tests" / "support" / "dist_step_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(args: list[str]) -> list[subprocess.Popen]:
    """The worker as ranks 0 and 1 of a gloo group on loopback (the caller kills them)."""
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(
            subprocess_env(),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def _run_two_ranks(out: Path, overrides: list[str]) -> None:
    """Both ranks to the end; every one killed (with its children) in the end."""
    procs = []
    try:
        procs = _start_ranks([str(out), *overrides])
        logs = [p.communicate(timeout=240)[0] for p in procs]
        for rank, (p, log) in enumerate(zip(procs, logs)):
            assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{log[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_overrides) -> Path:
    """The worker's outputs from 2 ranks (run once for this file's tests)."""
    out = tmp_path_factory.mktemp("two_ranks")
    _run_two_ranks(out, tiny_overrides)
    return out


def test_two_process_step_matches_one(two_ranks, tiny_overrides):
    tmp_path = two_ranks
    for case in CASES:
        ref, ref_stats = one_step(tiny_overrides, "none", case)
        assert any(float(v.abs().max()) > 1e-4 for k, v in ref.items() if k.startswith("grad/")), case
        for mode in ("ddp", "fsdp2"):
            got = load_file(tmp_path / f"{mode}_{case}.safetensors")
            stats = json.loads((tmp_path / f"{mode}_{case}.json").read_text())
            assert_matches(got, ref, f"{mode} {case}")
            # metrics combined over ranks: the scaled loss's mean, token-weighted means, the global norm
            for key in ("loss", "grad_norm", "entropy", "kl", "pg_loss", "learner/forward_tokens"):
                # skip_rows: no KL term; rank 1 runs its rows (no gradient) for its metrics, which one process leaves out
                if case == "skip_rows" and key in ("kl", "entropy", "learner/forward_tokens"):
                    continue
                assert stats[key] == pytest.approx(ref_stats[key], rel=1e-5, abs=1e-7), (mode, case, key)
            if case.startswith("gae"):  # issue 46: the critic's metrics, combined over ranks
                for key in (
                    "critic/value_loss",
                    "critic/grad_norm",
                    "critic/clipfrac",
                    "critic/explained_variance",
                    "critic/value_mean",
                    "critic/return_mean",
                ):
                    assert stats[key] == pytest.approx(ref_stats[key], rel=1e-5, abs=1e-6), (mode, case, key)
            if case == "shared_prefix":  # each prompt read once per bin on each rank's rows, as in one process
                assert stats["learner/shared_prompt_rows"] > 0 and ref_stats["learner/shared_prompt_rows"] > 0, mode
            if case.startswith("micro_"):  # several micro-batches, the gradients reduced once after the last
                assert stats["learner/micro_batches"] > 1 and ref_stats["learner/micro_batches"] >= 4, mode
            if case == "skip_rows":  # one process leaves group b out; rank 1, whose rows are all group b's, runs them
                assert ref_stats["learner/rows_skipped"] == 2 and stats["learner/rows_skipped"] == 0, mode
        assert any(k.startswith("optim/") for k in ref), "the optimizer state was not compared"
        if case.startswith("micro_"):  # and the one-process micro-batched gradient is the one-pass one of its mode
            # (gradients: AdamW divides by |g|, so rounding on a near-zero gradient moves a parameter by more)
            whole, _ = one_step(tiny_overrides, "none", case[len("micro_") :])
            for k in (k for k in ref if k.startswith("grad/")):
                assert float((ref[k] - whole[k]).abs().max()) <= 1e-5, (case, k)
        if case.startswith("gae"):  # the critic trained (every trainable tensor of it moved), its head too
            grads = {k: v for k, v in ref.items() if k.startswith("critic_grad/")}
            assert grads and min(float(v.abs().max()) for v in grads.values()) > 0, case
            assert any("lm_head" in k for k in grads) and any(k.startswith("optim/critic/") for k in ref), case
            assert ref_stats["critic/clipfrac"] > 0 or case == "gae_lora", ref_stats
        if case == "lora":  # issue 32: gradients and optimizer state for the adapters only, A's and B's
            trained = {k[len("grad/") :] for k in ref if k.startswith("grad/")}
            optimized = {k[len("optim/") :].rsplit("/", 1)[0] for k in ref if k.startswith("optim/")}
            assert trained and all(".lora_A." in k or ".lora_B." in k for k in trained), sorted(trained)[:5]
            assert optimized == trained, sorted(optimized ^ trained)[:5]
            assert min(float(ref[f"grad/{k}"].abs().max()) for k in trained) > 0


def _optim_dict(flat: dict) -> dict:
    """``optim/<name>/<key>`` tensors -> an optimizer state by parameter name (param_groups from a
    fresh optimizer's)."""
    state: dict = {}
    for k, v in flat.items():
        if k.startswith("optim/"):
            name, key = k[len("optim/") :].rsplit("/", 1)
            state.setdefault(name, {})[key] = v
    return state


def test_a_sharded_checkpoint_state_loads_into_one_process(two_ranks, tiny_overrides):
    """What an FSDP2 group saves (full parameters and the optimizer state by name, gathered from the
    shards) loads into a one-process model and optimizer and gives back exactly those states; the
    index-keyed optimizer state of checkpoints from before issue 15 converts to the same."""
    from asyncrl.config import load_config
    from asyncrl.learner.training.trainer import PolicyTrainer
    from asyncrl.models.loading import load_policy

    got = load_file(two_ranks / "fsdp2_token-mean.safetensors")
    cfg = load_config(None, tiny_overrides)
    model, tok, _ = load_policy(cfg.model, cfg.seed)
    trainer = PolicyTrainer(model, tok, cfg.train, 1.0)
    fresh = distributed.optimizer_state(model, trainer.optimizer)
    saved = {"state": _optim_dict(got), "param_groups": fresh["param_groups"]}
    params = {k[len("param/") :]: v for k, v in got.items() if k.startswith("param/")}
    assert set(saved["state"]) == {n for n, _ in model.named_parameters()}
    distributed.load_states(model, trainer.optimizer, params, saved)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), params[name]), name
    back = distributed.optimizer_state(model, trainer.optimizer)
    for name, entry in saved["state"].items():
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(back["state"][name][key]), v), (name, key)
    # the old format: Optimizer.state_dict() keys parameters by index
    old = trainer.optimizer.state_dict()
    assert isinstance(next(iter(old["state"])), int)
    converted = distributed.by_name(old, [n for n, _ in model.named_parameters()])
    for name, entry in converted["state"].items():
        assert torch.equal(entry["exp_avg"], saved["state"][name]["exp_avg"]), name


def test_shard_rows_covers_every_row_once_and_refuses_too_few():
    for n, world in [(5, 2), (8, 3), (3, 3)]:
        parts = [distributed.shard_rows(n, r, world) for r in range(world)]
        rows = [i for s in parts for i in range(n)[s]]
        assert rows == list(range(n))
        sizes = [s.stop - s.start for s in parts]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match="2 rows cannot be split over 3 ranks"):
        distributed.shard_rows(2, 0, 3)


def test_without_a_group_clear_errors_and_identity(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        distributed.init_from_env(5)
    with pytest.raises(ValueError, match="mode 'zero3' unknown"):
        distributed.wrap(torch.nn.Linear(2, 2), "zero3")
    with pytest.raises(ValueError, match="loss_agg_mode 'sum' unknown"):
        loss_scales(torch.ones(2, 3), "sum", Totals(6.0, 2.0))
    totals, parts = distributed.step_totals(torch.ones(2, 3), 4)  # one process: its own rows, its own count
    assert (totals, parts) == (Totals(6.0, 2.0, 1), 4)
    assert loss_scales(torch.ones(2, 3), "token-mean", totals) == (1.0, 1.0)
    # a micro-batch's share: a third of the tokens, half the sequences
    part = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert loss_scales(part, "token-mean", totals) == (pytest.approx(1 / 3), pytest.approx(1 / 3))
    assert loss_scales(part, "seq-mean-token-mean", totals)[0] == pytest.approx(1 / 2)
    assert loss_scales(part, "seq-mean-token-sum-norm", Totals(6.0, 2.0, 2))[0] == 2.0
    with distributed.gradient_sync(torch.nn.Linear(2, 2), sync=False):  # no group: nothing to hold back
        pass


def test_a_stalled_rank_makes_the_others_fail_after_the_timeout_not_hang():
    procs = []
    try:
        procs = _start_ranks(["--stalled-peer"])
        log = procs[0].communicate(timeout=120)[0]  # the group timeout is 3 s; 120 s means a hang
        assert procs[0].returncode == 3, log[-3000:]
        assert "collective failed after" in log, log[-3000:]
        assert procs[1].poll() is None  # the stalled rank never left its sleep: the timeout ended rank 0
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
