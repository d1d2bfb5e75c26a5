"""Two processes with `accelerate launch`: different packed rows per rank, no hang on uneven rows.

accelerate's `--cpu` launcher starts several processes only through MPI; torchrun (`--multi_gpu`) starts them on a
machine without GPUs too, and the processes then use the gloo backend on the CPU.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "ddp_train.py")


@pytest.mark.timeout(400)
def test_two_processes_get_different_packed_rows(tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        SCRIPT,
        str(tmp_path),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=380, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world_size"] == 2 for r in ranks)
    num_rows = ranks[0]["num_rows"]
    assert ranks[1]["num_rows"] == num_rows and num_rows % 2 == 1  # uneven on purpose: one rank is short a row
    assert ranks[0]["global_step"] == ranks[1]["global_step"]
    rows0 = [tuple(r) for r in ranks[0]["rows"]]
    rows1 = [tuple(r) for r in ranks[1]["rows"]]
    # every row is trained on; the only rows both ranks see are the few repeated to even out the last batches
    assert len(set(rows0) | set(rows1)) == num_rows
    assert len(set(rows0) & set(rows1)) <= 2 * 2
