import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: threads only add contention (and xdist runs 2 workers)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
