"""Issue 15 (first piece): one optimizer step over 2 gloo processes equals one process."""
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import kill_tree

WORKER = Path(__file__).with_name("dist_step_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str, nproc: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(WORKER), mode, str(out)]
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), mode, str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc)  # torchrun and its workers
    assert proc.returncode == 0, text[-2000:]
    return load_file(out)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_process_step_matches_one(tmp_path, mode):
    one = _run("none", 1, tmp_path / "one.safetensors")
    two = _run(mode, 2, tmp_path / "two.safetensors")
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), (k, (one[k] - two[k]).abs().max())
