"""The modules one batch of trajectories passes through on the learner, from the episodes taken out
of the buffer to the loss and the optimizer step (``PolicyTrainer.make_batch`` and ``step`` on a tiny
random model), traced with ``sys.setprofile``: how many modules, how many moves between them, and how
many returns to a module already left, by file and by room (a top-level package or module).

    python bench/trajectory_path.py              # this checkout
    python bench/trajectory_path.py --root DIR   # another checkout (e.g. a worktree of an older commit)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def trace(root: Path) -> list[str]:
    sys.path.insert(0, str(root))
    os.chdir(root)
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.config import load_config
    from asyncrl.types import Episode, Trajectory

    try:
        from asyncrl.learner.training.trainer import PolicyTrainer
    except ImportError:  # a checkout from before the learner's split
        from asyncrl.learner.trainer import PolicyTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
    )
    trainer = PolicyTrainer(model, type("Tok", (), {"pad_token_id": 0})(), load_config(None, []).train, 1.0)
    rng = np.random.default_rng(0)
    trajs = [
        Trajectory(
            task_id=f"t{g}",
            group_id=f"t{g}",
            token_ids=rng.integers(1, 32, 10).astype(np.int32),
            loss_mask=np.array([0] * 4 + [1] * 6, dtype=np.float32),
            behavior_logprobs=np.array([0] * 4 + [-1.0] * 6, dtype=np.float32),
            policy_version=0,
            reward=float(i % 2),
        )
        for g in range(2)
        for i in range(4)
    ]
    episodes = [Episode(trajectories=trajs[:4]), Episode(trajectories=trajs[4:])]
    seq: list[str] = []
    prefix = str(root / "asyncrl") + "/"

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(prefix):
            module = "asyncrl/" + name[len(prefix) :]
            if not seq or seq[-1] != module:
                seq.append(module)

    sys.setprofile(profile)
    try:
        trainer.step(trainer.make_batch(episodes), version=0)
    finally:
        sys.setprofile(None)
    return seq


def stats(seq: list[str]) -> tuple[int, int, int]:
    """(modules, moves, returns to a module already left) of a path."""
    path = [m for i, m in enumerate(seq) if i == 0 or seq[i - 1] != m]
    seen: set[str] = set()
    returns = 0
    for m in path:
        returns += m in seen
        seen.add(m)
    return len(seen), len(path) - 1, returns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="the checkout to trace")
    args = ap.parse_args()
    seq = trace(args.root.resolve())
    rooms = ["/".join(m.split("/")[:2]) for m in seq]
    for what, path in (("files", seq), ("rooms", rooms)):
        n, moves, returns = stats(path)
        print(f"{what}: {n} modules, {moves} moves, {returns} returns to a module already left")
    print(" -> ".join(m for i, m in enumerate(seq) if i == 0 or seq[i - 1] != m))


if __name__ == "__main__":
    main()
