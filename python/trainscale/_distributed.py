"""How a program running as a torchrun worker ends (trainscale.train, the bench's distributed
muon suite, the distributed Muon check)."""
import os
import sys

import torch.distributed as dist


def exit_worker(status: int = 0):
    """Waits for every rank, then leaves with os._exit(status). Tearing down the process group and
    the interpreter after a finished run has aborted a rank now and then ("terminate called
    without an active exception" from a thread of the distributed runtime still running at exit,
    seen with gloo); the caller has written what it reports by then, so skipping that teardown
    loses nothing. A failing rank raises as usual instead of calling this."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
