import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP spinning makes each
# small matmul 10x slower. Tests on real models set their own thread count.
torch.set_num_threads(1)
