"""Two ranks at ZeRO 1, where each rank writes its own optimizer partition file.

--phase crash: train 2 steps and save (a complete checkpoint), train 2 more, then save again while
rank 1's disk "fills up" writing its optimizer partition. Rank 0 finishes its own files; rank 1
dies. --phase resume: new processes resume from the same directory and report where they are.
"""
import argparse
from pathlib import Path

import torch

from helpers.data import SyntheticTextDataset
from helpers.launch import write_result
from helpers.runtime import process_rank
from tests.trainers import make_trainer

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--phase", choices=("crash", "resume"), required=True)
a = parser.parse_args()
checkpoints = Path(a.out).parent / "checkpoints"
data = SyntheticTextDataset("markov", n_samples=128, seq_len=32, seed=0)
trainer = make_trainer(data, zero_stage=1, micro_batch=4, warmup_steps=2, total_steps=20, output_dir=Path(a.out) / "run",
                       resume_from=checkpoints if a.phase == "resume" else None)
if a.phase == "crash":
    trainer.train(2, progress=False)
    trainer.save_checkpoint(checkpoints)
    trainer.train(2, progress=False)
    if process_rank() == 1:
        real_save = torch.save

        def disk_full(obj, f, *args, **kwargs):
            if "optim_states" in str(f):
                raise OSError("disk full (simulated crash mid-save on rank 1)")
            return real_save(obj, f, *args, **kwargs)
        torch.save = disk_full
    trainer.save_checkpoint(checkpoints)   # rank 1 raises; rank 0 waits at the barrier until stopped
write_result(a.out, {"step": trainer.step, "position": trainer.batches.position})
torch.distributed.destroy_process_group()   # gloo's threads end before exit can abort them (SIGABRT)
