"""gradsync where users already train, each framework's script run as a user runs it, under
torchrun on 2 CPU ranks (gloo), with the real package (gradsync's `accelerate` and `lightning`
extras):

  accelerate_script.py  prepare, register on the prepared model, bf16, gradient accumulation,
                        save_state / load_state through gradsync.AllRanks;
  lightning_script.py   Trainer(strategy="ddp") with gradsync.lightning.GradSync, a checkpoint
                        saved at step 8 and fit(ckpt_path=...) from it; then
                        DDPStrategy(ddp_comm_hook=gradsync.hook, ddp_comm_state=SyncState(config)),
                        which must train exactly as the callback does.

Each trains 16 steps without a break, and 8 + a resume into a fresh model (initialized
differently) + 8: parameters and gradsync's own state must be bit-identical at step 16 on every
rank. Both frameworks write checkpoints from rank 0 only. A state saved that way by state_dict()
would hold rank 0's error memories alone: the ranks' memories differ (checked), so a resume that
gave rank 1 rank 0's memory would leave the trajectory, and one that dropped the state would be at
step 8, not 16.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).parent


def torchrun(script: Path, *args: str, timeout_s: float = 240) -> None:
    """Run `script` on 2 ranks under torchrun, as a user would; its output on failure."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(
        [*command, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


def same(a: Any, b: Any) -> bool:
    """Nested dicts and lists of tensors and plain values, equal to the bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize(
    ("package", "script"), [("accelerate", "accelerate_script.py"), ("lightning", "lightning_script.py")]
)
def test_a_framework_checkpoint_resumes_bit_for_bit(package: str, script: str, tmp_path: Path) -> None:
    pytest.importorskip(package, reason=f"the {package} extra: pip install -e '.[{package}]'")
    torchrun(HERE / script, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for rank, out in enumerate(ranks):
        assert out["compression_ratio"] > 4, f"rank {rank}: gradsync did not compress: {out}"
        assert out["resumed_state"]["step"] == 16, f"rank {rank}: gradsync's state was not restored"
        assert same(out["resumed_state"], out["continuous_state"]), f"rank {rank}: gradsync state differs"
        diff = (out["resumed"] - out["continuous"]).abs().max().item()
        assert torch.equal(out["resumed"], out["continuous"]), f"rank {rank} left the trajectory: {diff:.3g}"
    memories = [out["continuous_state"]["points"] for out in ranks]
    assert not same(*memories), "both ranks hold the same memories: the test cannot tell them apart"
    if package == "lightning":  # the comm hook's state, made before the process group, bound to it
        for rank, out in enumerate(ranks):
            # validate(ckpt_path=...) restores the callbacks too; the fit after it starts afresh.
            assert torch.equal(out["after_validate"], out["continuous"]), (
                f"rank {rank}: validate's state leaked"
            )

            assert out["comm_hook_state"]["rank"] == rank and out["comm_hook_state"]["world_size"] == 2
            assert out["comm_hook_state"]["step"] == 16, f"rank {rank}: the comm hook did not run every step"
            assert same(out["comm_hook_state"]["points"], out["continuous_state"]["points"])
            assert torch.equal(out["comm_hook"], out["continuous"]), f"rank {rank}: comm hook run differs"
