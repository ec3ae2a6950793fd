"""DeepEP's internode test shape (tests/internode_cases.py: 1024 tokens, H=7168, top-8 within the best 2
node groups, the workspace sized exactly for the batch) on one node of real GPUs, one rank each:
the automatic backend there is nvlink. Usage: ``python3 scripts/internode_shape_one_node.py
[num_sms ...]``; prints one line per SM count."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # the project's GPU cases

if __name__ == "__main__":
    from epcomm.testing import WorkerPool
    from internode_cases import internode_against_reference
    R = torch.cuda.device_count()
    with WorkerPool(R, backend="nccl") as pool:
        for num_sms in [int(v) for v in sys.argv[1:]] or [24]:
            try:
                result = pool.run(internode_against_reference, 1024, 7168, 16, 8, 2, (num_sms, 8, 512, 16, 128),
                                  timeout_s=240)
                print(f"R={R} num_sms={num_sms}: {result[0]}", flush=True)
            except Exception as exc:  # the pool closes after a failure: the rest are not run
                print(f"R={R} num_sms={num_sms}: FAILED {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
                break
